"""What crosses the engine's boundaries each step, as plain values: the scheduler's plan (SchedulerOutput), the
runner's sampled tokens (RunnerOutput), the events streamed to clients (StepEvent) and the step's record
(StepRecord), which the replays, the servers' metrics and the simulator's cost model read."""
from dataclasses import dataclass, field

from engine.core.request import SamplingParams


@dataclass(frozen=True)
class ScheduledChunk:
    rid: str
    start: int                         # position of the first token in the sequence
    tokens: tuple[int, ...]            # a whole prompt, a prompt chunk, one decode token (and its draft)
    sample: bool                       # take a token from the chunk's last position
    prompt: bool = False               # the tokens are (part of) the prompt
    zombie: bool = False               # a finished row kept in a static batch: computed, then discarded
    seat: int | None = None            # slot cache: the row holding the request's K/V
    blocks: tuple[int, ...] = ()       # paged KV: the request's block table (its positions in order)
    tables: dict | None = None         # paged KV in LayerPools: window -> the request's table in that pool
    params: SamplingParams | None = None  # the request's sampling, on chunks that sample
    history: tuple[list[int], list[int]] | None = None  # (prompt, output) ids, for penalized sampling
    draft: tuple[int, ...] = ()        # a decode row's drafted tokens, the last of `tokens`, verified this step


@dataclass(frozen=True)
class KVUsage:
    """The KV cache after a step's plan: what its requests hold and what is reserved for them."""
    num_running: int = 0
    kv_tokens: int = 0                 # tokens whose K/V the running requests hold once the step has run
    kv_reserved_tokens: int = 0        # held or reserved: whole seats (slot cache), whole blocks (paged)
    blocks_used: int | None = None     # paged KV only
    blocks_free: int | None = None
    queried_tokens: int = 0            # paged: tokens of sequences admitted this step, looked up in the prefix cache


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...] = ()
    new_ids: tuple[str, ...] = ()        # admitted this step
    finished_ids: tuple[str, ...] = ()   # finished since the last step (aborts included): free their state
    preempted_ids: tuple[str, ...] = ()  # preempted since the last step (paged KV out of blocks)
    num_pad_tokens: int = 0              # of which left-padding, computed and discarded (padded batch policies)
    num_cached_tokens: dict[str, int] = field(default_factory=dict)  # rid in new_ids -> prefix-cache hit tokens
    kv: KVUsage = KVUsage()

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {c.rid: len(c.tokens) for c in self.chunks}

    @property
    def total_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)  # padding chunks included

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(c.draft) for c in self.chunks)

    @property
    def num_useful_rows(self) -> int:
        """Rows whose token is kept."""
        return sum(1 for c in self.chunks if c.sample and not c.zombie)

    @property
    def kind(self) -> str:
        """"idle", "prefill", "decode" or "mixed" (prompt tokens and decodes in one pass)."""
        if not self.chunks:
            return "idle"
        prompt = any(c.prompt for c in self.chunks)
        decode = any(not c.prompt for c in self.chunks)
        return "mixed" if prompt and decode else ("prefill" if prompt else "decode")

    def features(self) -> dict[str, int]:
        return step_features(self.chunks)


def step_features(chunks, more: dict[str, int] | None = None) -> dict[str, int]:
    """The cost features of a step of these chunks (engine.core.simulator.FEATURES), each chunk whose rid is in
    `more` carrying that many more drafted tokens (the adaptive speculation's candidates), in one pass:
    num_prompt_tokens: prompt tokens fed (whole prompts, chunks and padding); num_decode_rows: decode rows through
    the layers, one per decoding request (zombies included) and one per drafted token; num_sampled_rows: rows the LM
    head and the sampler see, one per chunk that samples and one per drafted token; decode_attention: query-key pairs
    per head of the one-token rows as the padded path computes them (on seats one query per seat up to the highest
    decoding one, on blocks one per decode; each against the longest decoding context); prompt_attention: those of
    every multi-token chunk (drafted rows included) padded to the longest, against keys up to the furthest chunk
    end; is_mixed: prompt tokens and decodes in one pass; multi_row: more than one row through the layers
    (matrix-matrix products, a different kernel from one row's)."""
    more = more or {}
    prompt = decode = sampled = total = 0
    decodes, seat_top, context, multi, longest, furthest = 0, None, 0, 0, 0, 0
    for c in chunks:
        extra = more.get(c.rid, 0)
        n = len(c.tokens) + extra
        total += n
        if c.prompt:
            prompt += n
        else:
            decode += n
        if c.sample:
            sampled += 1 + len(c.draft) + extra
        if n == 1:
            decodes += 1
            context = max(context, c.start + 1)
            if c.seat is not None:
                seat_top = c.seat if seat_top is None else max(seat_top, c.seat)
        else:
            multi += 1
            longest, furthest = max(longest, n), max(furthest, c.start + n)
    rows = decodes if seat_top is None else seat_top + 1
    return {"num_prompt_tokens": prompt, "num_decode_rows": decode, "num_sampled_rows": sampled,
            "decode_attention": rows * context if decodes else 0, "prompt_attention": multi * longest * furthest,
            "is_mixed": int(prompt > 0 and decode > 0), "multi_row": int(total > 1)}


@dataclass(frozen=True)
class RunnerOutput:
    tokens: dict[str, int]             # rid -> the token sampled for each chunk that samples (a drafted row's last)
    logprobs: dict[str, tuple[float, tuple[tuple[int, float], ...]]] = field(default_factory=dict)
    # rid -> (the token's logprob, its top alternatives (id, logprob)), for the rows that asked
    accepted: dict[str, tuple[int, ...]] = field(default_factory=dict)  # drafted rows: the drafts kept, before `tokens`
    accepted_logprobs: dict[str, tuple] = field(default_factory=dict)   # drafted rows that asked: one per draft kept


@dataclass(frozen=True)
class StepEvent:
    rid: str
    token: int | None                  # None for an abort or a failure
    finish_reason: str | None          # on the request's last event: "stop", "length", "abort", "error", "shutdown"
    logprob: float | None = None       # the token's log-probability, if asked
    top_logprobs: tuple[tuple[int, float], ...] | None = None  # (token id, log-probability), most likely first
    error: str | None = None           # why the request failed ("error" or "shutdown")
    cached_tokens: int = 0             # its prompt tokens found in the prefix cache (at its latest admission)


@dataclass(frozen=True)
class StepRecord:
    """One forward pass: its timing (s, on the engine's clock), what it computed and the KV cache around it."""
    start: float
    duration: float
    kind: str
    num_tokens: int
    num_pad_tokens: int
    useful_rows: int
    computed_rows: int
    num_new: int
    cached_tokens: int                 # prefix-cache hits of the requests admitted
    preempted: int
    num_running: int
    kv_tokens: int
    kv_reserved_tokens: int
    blocks_used: int | None
    blocks_free: int | None
    queried_tokens: int
    num_prompt_tokens: int
    num_decode_rows: int
    num_sampled_rows: int
    decode_attention: int
    prompt_attention: int
    is_mixed: int
    multi_row: int
    num_draft_tokens: int              # drafted tokens verified (speculative decoding)

    @classmethod
    def of(cls, plan: SchedulerOutput, start: float, end: float) -> "StepRecord":
        kv, features = plan.kv, plan.features()
        return cls(start, end - start, plan.kind, plan.total_tokens, plan.num_pad_tokens, plan.num_useful_rows,
                   features["num_sampled_rows"], len(plan.new_ids), sum(plan.num_cached_tokens.values()),
                   len(plan.preempted_ids), kv.num_running, kv.kv_tokens, kv.kv_reserved_tokens, kv.blocks_used,
                   kv.blocks_free, kv.queried_tokens, **features, num_draft_tokens=plan.num_draft_tokens)
