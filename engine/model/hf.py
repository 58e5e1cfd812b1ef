"""Hugging Face `generate`, the reference the engine is measured against: inputs always on the model's device."""
import torch


def left_padded(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask), each [B, longest], prompts left-padded so every row's last token is aligned."""
    longest = max(map(len, prompts))
    ids = [[pad_id] * (longest - len(p)) + list(p) for p in prompts]
    mask = [[0] * (longest - len(p)) + [1] * len(p) for p in prompts]
    return (torch.tensor(ids, dtype=torch.long, device=device), torch.tensor(mask, dtype=torch.long, device=device))


def generate_padded(model, prompts: list[list[int]], new_tokens: int, pad_id: int, min_new_tokens: int | None = None,
                    **kwargs) -> torch.Tensor:
    """One left-padded batch generate; greedy unless kwargs say otherwise. Returns [B, longest + new] token ids."""
    ids, mask = left_padded(prompts, pad_id, model.device)
    kwargs.setdefault("do_sample", False)
    with torch.inference_mode():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, pad_token_id=pad_id,
                              min_new_tokens=new_tokens if min_new_tokens is None else min_new_tokens, **kwargs)


def generate_alone(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy generate on one request alone: exactly `new_tokens` new tokens (EOS suppressed until then)."""
    return generate_padded(model, [prompt], new_tokens, 0)[0, len(prompt):].tolist()
