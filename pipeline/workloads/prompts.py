"""Prompt token ids for benchmarks and workloads: short chat prompts, or long ones of an exact token count.

With a tokenizer, prompts are real chat messages through the model's chat template; without one (random-weight
models), they are seeded random token ids of similar lengths.
"""
import random

import numpy as np

CHAT = [
    "Write a haiku about memory bandwidth.", "What is 17 times 23?",
    "Name three rivers in Europe and one fact about each.", "Explain batching to a child.", "hi",
    "Tell me a long story about a dragon who learns to code and opens a bakery.",
    "Summarize the plot of Hamlet in two sentences.", "Give me a recipe for pancakes.",
    "What causes the seasons on Earth?", "Translate 'good morning, how are you?' into French.",
    "List five prime numbers greater than 100.", "Why is the sky blue?",
    "Write a limerick about a cat who hates Mondays.", "How does a hash table work?",
    "What is the capital of Australia, and why is it not Sydney?", "Describe the taste of an orange.",
    "Suggest three names for a bakery run by a dragon.", "Explain what a GPU does in one paragraph.",
    "What is the difference between weather and climate?", "Write a short poem about rain on a tin roof.",
    "How many legs does a spider have?", "Give two tips for learning to play the guitar.",
    "What is photosynthesis?", "Write a polite email declining a meeting invitation.",
]
FILLER = ("The history of computing is a story of memory and arithmetic racing each other. Each generation of "
          "machines made one faster, and the other became the bottleneck, until the next design turned it around. ")


def chat_ids(tokenizer, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(out["input_ids"])


def short_prompts(n: int, tokenizer=None, vocab_size: int = 512, seed: int = 0) -> list[list[int]]:
    """n short chat prompts, cycling through CHAT (random ids of 10 to 40 tokens without a tokenizer)."""
    rng = random.Random(seed)
    if tokenizer is None:
        return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(10, 40))] for _ in range(n)]
    return [chat_ids(tokenizer, CHAT[i % len(CHAT)]) for i in range(n)]


def long_prompts(n: int, length: int, tokenizer=None, vocab_size: int = 512, seed: int = 0) -> list[list[int]]:
    """n prompts of exactly `length` tokens, each a numbered filler document then a CHAT question (seeded random
    ids without a tokenizer)."""
    rng = random.Random(seed)
    if tokenizer is None:
        return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(n)]
    return [document_ids(tokenizer, i, length) for i in range(n)]


def document_ids(tokenizer, i: int, length: int) -> list[int]:
    """Exactly `length` tokens of chat prompt i: a numbered filler document then a CHAT question, the template's
    closing 8 tokens kept (only the last `length` of them when shorter)."""
    question = chat_ids(tokenizer, f"Document {i}: " + FILLER * (length // 30 + 2) + CHAT[i % len(CHAT)])
    return question[:length - 8] + question[-8:] if length > 8 else question[-length:]


def sized_prompts(lengths, tokenizer=None, vocab_size: int = 512, seed: int = 0) -> list[list[int]]:
    """One prompt of each length: numbered chat documents (seeded random ids in [3, vocab) without a tokenizer)."""
    if tokenizer is None:
        rng = np.random.default_rng(seed)
        return [rng.integers(3, vocab_size, int(n)).tolist() for n in lengths]
    return [document_ids(tokenizer, i, int(n)) for i, n in enumerate(lengths)]


def prompts_for(shape, n: int, tokenizer=None, vocab_size: int = 512, seed: int = 0) -> list[list[int]]:
    """shape: "chat" for short chat prompts, or an int for prompts of exactly that many tokens."""
    if shape == "chat":
        return short_prompts(n, tokenizer, vocab_size, seed)
    return long_prompts(n, int(shape), tokenizer, vocab_size, seed)
