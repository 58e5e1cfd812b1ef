"""A request's parameters (validated at the API) and its state as it moves through the engine."""
from dataclasses import dataclass, field
from enum import Enum


class RequestError(ValueError):
    """A request the engine refuses; `field` names the offending field (for a 400 at the server)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0   # 0 = greedy
    top_p: float = 1.0         # nucleus mass kept, (0, 1]
    top_k: int = 0             # 0 = off
    seed: int | None = None    # per-request RNG seed; None draws from the engine's seeded RNG
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0    # subtracted once from each token already in the output, [-2, 2]
    frequency_penalty: float = 0.0   # subtracted per occurrence in the output, [-2, 2]
    repetition_penalty: float = 1.0  # as HF: seen tokens (prompt + output): positive logit / it, negative * it
    logprobs: int | None = None      # None: none; k: the chosen token's logprob and the k most likely, [0, 20]

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def validate(self, vocab_size: int) -> None:
        def need(ok: bool, name: str, msg: str):
            if not ok:
                raise RequestError(name, msg)

        need(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, "max_new_tokens",
             f"must be an integer >= 1, got {self.max_new_tokens!r}")
        need(isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0, "temperature",
             f"must be in [0, 100], got {self.temperature!r}")
        need(isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0, "top_p",
             f"must be in (0, 1], got {self.top_p!r}")
        need(isinstance(self.top_k, int) and 0 <= self.top_k <= vocab_size, "top_k",
             f"must be an integer in [0, {vocab_size}], got {self.top_k!r}")
        need(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63), "seed",
             f"must be an integer in [0, 2**63), got {self.seed!r}")
        need(all(isinstance(t, int) and 0 <= t < vocab_size for t in self.stop_token_ids), "stop_token_ids",
             f"must be token ids in [0, {vocab_size})")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            need(isinstance(v, (int, float)) and -2.0 <= v <= 2.0, name, f"must be in [-2, 2], got {v!r}")
        need(isinstance(self.repetition_penalty, (int, float)) and 0.0 < self.repetition_penalty <= 2.0,
             "repetition_penalty",
             f"must be in (0, 2], got {self.repetition_penalty!r}")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20), "logprobs",
             f"must be an integer in [0, 20], got {self.logprobs!r}")


def check_request(prompt: list[int], params: SamplingParams, vocab_size: int, max_request_tokens: int) -> None:
    """Raise RequestError, naming the field and the limit, for a request no engine of these limits would take."""
    if not isinstance(prompt, list) or not prompt:
        raise RequestError("prompt", "must be a non-empty list of token ids")
    if not set(map(type, prompt)) <= {int} or min(prompt) < 0 or max(prompt) >= vocab_size:  # C loops: long prompts
        raise RequestError("prompt", f"token ids must be integers in [0, {vocab_size})")
    params.validate(vocab_size)
    total = len(prompt) + params.max_new_tokens
    if total > max_request_tokens:
        raise RequestError("max_new_tokens",
                           f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                           f"= {total} exceeds max_request_tokens = {max_request_tokens}")


def stop_reason(params: SamplingParams, eos_ids, token: int, num_output: int) -> str | None:
    """Why a request ends after appending `token` as its `num_output`-th token: "stop", "length", or None."""
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids):
        return "stop"
    return "length" if num_output >= params.max_new_tokens else None


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    arrival: float = 0.0                              # s, on the engine's clock
    status: Status = Status.WAITING
    seat: int | None = None                           # its row of the slot cache while running there
    num_computed: int = 0                             # tokens of the sequence (prompt + output) whose K/V are cached
    output: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # s, one per output token
    admit_time: float | None = None                   # s, the first admission
    finish_time: float | None = None
    finish_reason: str | None = None                  # "stop" | "length" | "abort"
    replayed: int = 0                                 # output tokens prefilled again with the prompt after a preemption
    num_cached: int = 0                               # tokens found in the prefix cache at the latest admission
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def prefill_len(self) -> int:
        """Tokens computed as a prefill: the prompt, and after a preemption the output produced before it."""
        return len(self.prompt) + self.replayed

    @property
    def in_prompt(self) -> bool:
        """Still has prefill tokens whose K/V are not yet computed."""
        return self.num_computed < self.prefill_len

    def tokens(self, start: int, end: int) -> list[int]:
        """The sequence (prompt + output) from position start to end."""
        n = len(self.prompt)
        if start >= n:  # within the output (a decode row)
            return self.output[start - n:end - n]
        return self.prompt[start:end] if end <= n else self.prompt[start:] + self.output[:end - n]

    def next_tokens(self, limit: int) -> list[int]:
        """Up to `limit` tokens not yet computed: a prefill chunk, or the last sampled token."""
        return self.tokens(self.num_computed, self.num_computed + limit)
