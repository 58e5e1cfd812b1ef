"""A draft model for speculative decoding: a smaller Hugging Face model with the target's vocabulary proposes
greedily (engine/core/speculation.py's drafter interface: propose(request, k), forget(rid)). Its tokens are point
proposals, so verification stays exact whatever the draft; a poor draft only lowers acceptance."""
import torch


class DraftModel:
    def __init__(self, hf_model, vocab_size: int):
        """hf_model: a causal LM; vocab_size: the target's, which the draft's must equal."""
        if hf_model.config.vocab_size != vocab_size:
            raise ValueError(f"a draft model needs the target's vocabulary ({vocab_size} ids); this one has "
                             f"{hf_model.config.vocab_size}")
        self.model = hf_model.eval()

    @torch.inference_mode()
    def propose(self, req, k: int) -> tuple[int, ...]:
        """k tokens by the draft's argmax after the request's sequence (its context computed again each step, the
        k tokens through the draft's own cache)."""
        x = torch.tensor([req.tokens(0, req.num_tokens)], device=self.model.device)
        cache, out = None, []
        for _ in range(k):
            step = self.model(input_ids=x, cache=cache, use_cache=True)
            cache = step.cache
            out.append(int(step.logits[0, -1].float().argmax()))
            x = x.new_tensor([[out[-1]]])
        return tuple(out)

    def forget(self, rid: str) -> None:
        """Nothing is kept per request."""
