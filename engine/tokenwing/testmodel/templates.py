"""Chat templates of the generated models, one per tokenizer family, written for this project.

Each renders (in the engine's sandbox) exactly what llama.cpp's built-in handler for that family writes
(`llama_chat_apply_template`, src/llama-chat.cpp), and contains the strings by which llama.cpp recognises it.
"""

from tokenwing.text import chat

# ChatML (Qwen): <|im_start|>role\ncontent<|im_end|>\n — the engine's own, its fallback for models without one
CHATML = chat.CHATML

# DeepSeek-V3: the system prompt first, then <｜User｜>… and <｜Assistant｜>…<｜end▁of▁sentence｜> (the BOS
# comes from the tokenizer: add_bos_token).
DEEPSEEK_V3 = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- message['content'] + '\\n\\n' }}"
    "{%- elif message['role'] == 'user' %}{{- '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}"
)

# Kimi K2: <|im_ROLE|>role<|im_middle|>content<|im_end|> (tool results under the system marker).
KIMI_K2 = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- '<|im_system|>system<|im_middle|>' }}"
    "{%- elif message['role'] == 'user' %}{{- '<|im_user|>user<|im_middle|>' }}"
    "{%- elif message['role'] == 'assistant' %}{{- '<|im_assistant|>assistant<|im_middle|>' }}"
    "{%- elif message['role'] == 'tool' %}{{- '<|im_system|>tool<|im_middle|>' }}"
    "{%- endif %}"
    "{{- message['content'] + '<|im_end|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_assistant|>assistant<|im_middle|>' }}{%- endif %}"
)

# gpt-oss (harmony): <|start|>role<|message|>content<|end|>, an assistant turn ending in <|return|>; the model
# answers after <|start|>assistant with <|channel|>analysis<|message|>…<|end|> and then the final channel.
HARMONY = (
    "{#- harmony: the reply comes on channels, <|channel|>analysis then <|channel|>final #}"
    "{%- for message in messages %}"
    "{{- '<|start|>' + message['role'] + '<|message|>' + message['content'] }}"
    "{%- if message['role'] == 'assistant' %}{{- '<|return|>' }}{%- else %}{{- '<|end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)

# GLM-4.5 (our own, in its shape): [gMASK]<sop>, then <|role|>\ncontent per message, the reply after
# <|assistant|>\n; a turn ends where the next role marker begins (the file's EOT is <|user|>).
GLM4 = (
    "[gMASK]<sop>"
    "{%- for message in messages %}{{- '<|' + message['role'] + '|>\\n' + message['content'] }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)

# Ling 2.0 / 3.0 (our own, in its shape): <role>ROLE</role>content<|role_end|>, roles in capitals.
LING = (
    "{%- set names = {'system': 'SYSTEM', 'user': 'HUMAN', 'assistant': 'ASSISTANT', 'tool': 'OBSERVATION'} %}"
    "{%- for message in messages %}"
    "{{- '<role>' + names.get(message['role'], 'HUMAN') + '</role>' + message['content'] + '<|role_end|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<role>ASSISTANT</role>' }}{%- endif %}"
)

# MiniMax M2 (our own, in its shape): ]~!b[ once, then ]~b]role\ncontent[e~[\n, the model answering as `ai`.
MINIMAX_M2 = (
    "]~!b["
    "{%- for message in messages %}"
    "{{- ']~b]' + ('ai' if message['role'] == 'assistant' else message['role']) + '\\n' + message['content'] }}"
    "{{- '[e~[\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- ']~b]ai\\n' }}{%- endif %}"
)

# ERNIE 4.5 (our own, in its shape): plain-text roles after <|begin_of_sentence|>, replies closed by
# <|end_of_sentence|>.
ERNIE = (
    "<|begin_of_sentence|>"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- 'User: ' + message['content'] + '\\n' }}"
    "{%- elif message['role'] == 'assistant' %}{{- 'Assistant: ' + message['content'] + '<|end_of_sentence|>' }}"
    "{%- else %}{{- message['content'] + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'Assistant: ' }}{%- endif %}"
)

# Mistral v7 (Mistral Small 3.1+, Small 4; our own, in its shape): [SYSTEM_PROMPT] …[/SYSTEM_PROMPT], [INST] …[/INST],
# each reply followed by </s>; llama.cpp recognises it by [SYSTEM_PROMPT] and writes a space after each opening marker
# and before each reply (its mistral-v7 handler); the BOS comes from the tokenizer (add_bos).
MISTRAL_V7 = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT] ' + message['content'] + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST] ' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- ' ' + message['content'] + '</s>' }}"
    "{%- endif %}"
    "{%- endfor %}"
)
