"""A small built-in text the test tokenizer is trained on (written for this project, no third-party text).

It mixes prose, numbers, punctuation, code and a few non-ASCII words so the merges cover common shapes.
"""

CORPUS = """\
TokenWing streams the routed experts of a mixture-of-experts model from the drive into memory it manages
itself. Each token needs only a few experts, so most of the model sits unused at any moment. The engine
predicts which experts the next layers will select, reads them early, and keeps the hottest ones in RAM.
When the prediction is right, the read has landed before the layer needs it; when it is wrong, the demand
read goes first and the prefetch waits.

A game engine works the same way: it streams in what is about to appear and evicts what was left behind.
The world is far larger than memory, yet the frame rate stays smooth, because the next corner is known.
Models were thought to be unpredictable, but the residual stream changes little from one layer to the next.

Run My AI is the desktop app around the engine. You pick a model from the library, the autotuner sizes the
caches for your machine, and you chat. Beside the chat, graphs show the hit rate of every layer, the time
each token waited on the drive, and how many bytes were read. Nothing leaves your computer.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 4096 65536 3.14159 2.71828 1e-5 0.5 -1 +7 42%
Dates and times: 2026-11-29 21:18:37, 12:00 PM, 1999/12/31. Prices: $19.99, 5 EUR, 100 yen.
Punctuation: "quoted", 'single', (parentheses), [brackets], {braces}, <angles>, a/b, a\\b, a|b, a&b, a*b.
Contractions: it's, don't, we're, they've, I'm, you'll, she'd, isn't, can't, won't.

def read_expert(index, layer, expert):
    offset = index.layer_offset[layer] + expert * index.record_size[layer]
    return os.pread(fd, index.record_size[layer], offset)

for layer in range(n_layers):
    hidden = attention(hidden, layer) + hidden
    selected = router(hidden, layer).topk(k)
    hidden = hidden + sum(weight * expert(hidden) for expert, weight in selected)

class Cache:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.values = {}

    def evict(self):
        return min(self.values, key=self.values.get)

if x == 1 and y != 2 or z >= 3 and w <= 4: print(f"{x} {y!r}")  # comment
JSON: {"model": "qwen3moe", "layers": 48, "experts": 128, "top_k": 8, "ok": true, "note": null}

Other scripts: café, naïve, über, Straße, año, façade, smörgåsbord, Ελληνικά, русский, 日本語, 中文, 한국어, emoji 🙂🚀.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. Sphinx of black quartz,
judge my vow. How vexingly quick daft zebras jump! The five boxing wizards jump quickly.
Once upon a time there was a small machine with two cores and a slow drive. It wanted to run the biggest
model in the world. Everyone said it could not be done, so it read only what it needed, just in time.
"""

# Written for this project as well: the same kinds of text in more scripts, for the vocabularies of the
# multilingual families (deepseek-v3, kimi-k2, gpt-4o), so their merges cover what their pre-tokenizers split.
MULTILINGUAL = """\
Модель читает только нужных экспертов, а остальные ждут на диске. Быстрый ответ, медленный диск, умный кэш.
Память маленькая, модель большая: каждый слой выбирает восемь экспертов из двухсот пятидесяти шести.
النموذج يقرأ الخبراء من القرص عند الحاجة فقط، والذاكرة تحفظ الأكثر استخداما. كل طبقة تختار ثمانية خبراء.
模型只读取需要的专家，其余的留在硬盘上。每一层从二百五十六个专家中选择八个。内存小，模型大，缓存聪明。
このモデルは必要な専門家だけを読み込みます。メモリは小さく、モデルは大きい。キャッシュが賢く働きます。
모델은 필요한 전문가만 읽고 나머지는 디스크에 둡니다. 메모리는 작고 모델은 큽니다.
Το μοντέλο διαβάζει μόνο τους ειδικούς που χρειάζεται. हर परत आठ विशेषज्ञ चुनती है, बाकी डिस्क पर रहते हैं।
Numbers run long: 1234567890 31415926535 2718281828 100000 65535 4294967296 0.000123 1e10 3,141,592.
Emoji and symbols: 🙂🚀🔥✅ ★☆ →← ±×÷ €£¥ © ® ™ ½ ¼ — “quotes” ‘single’ «guillemets» 「括弧」 【注】
Whitespace:   three spaces,\ttab,\t\ttwo tabs,
runs of    four spaces      and six before a newline
It's we're they'll I'd she's HE'S WE'VE You'LL don't DON'T o'clock rock'n'roll.
fn main() { let xs: Vec<u32> = (0..10).map(|x| x * x).collect(); println!("{:?}", xs); }
SELECT name, COUNT(*) FROM experts WHERE layer >= 3 GROUP BY name ORDER BY 2 DESC;
<div class="note">Hello&nbsp;world</div> https://example.com/path?q=1&r=2#frag user@example.org
CamelCaseWords snake_case_words kebab-case-words UPPERCASE lowercase MiXeD ÀÉÎÕÜ àéîõü ÇçŞşĞğ ĄąĘęŁł
"""
