"""Tool calls: each model family's native call format read back into OpenAI's `tool_calls`.

One module per format family (qwen, glm, deepseek, kimi, minimax, mistral; gpt-oss's harmony messages are read by
text/reasoning.py's HarmonyParser, whose channels they are part of), the shared reader in base.py, and in
reply.py the choice of format by what the model's chat template contains and the reader of a whole reply
(reasoning, content, calls). docs/api.md says what the server does with them."""
