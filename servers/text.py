"""Token ids to streamed text: incremental and safe across multi-byte characters, with OpenAI stop strings.

A tokenizer with a Rust backend decodes through its DecodeStream (one step per token, in Rust, instead of two
Python-side decodes); any other decodes a short window per token (a window ending in U+FFFD waits for the next
token)."""
from tokenizers.decoders import DecodeStream


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            stream = DecodeStream(skip_special_tokens=True)
            self._piece = lambda token: stream.step(backend, token) or ""
        else:
            self._piece = self._window_piece
        self.ids: list[int] = []
        self.prefix = self.read = 0   # ids[prefix:read] were decoded already; they give context to the next piece
        self.held = ""                # decoded text not yet emitted: a stop string may be starting in it
        self.keep = max((len(s) - 1 for s in self.stop), default=0)  # characters held back until more come
        self.stopped = False          # a stop string was seen: emit nothing more

    def _window_piece(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def add(self, token: int | None, final: bool = False) -> str:
        """Feed one token (or None); return the text that may be emitted now."""
        if self.stopped:
            return ""
        if token is not None:
            self.held += self._piece(token)
        end = len(self.held)
        for s in self.stop:  # a match cannot start in emitted text: it was searched whole, less than a stop held back
            i = self.held.find(s)
            if i >= 0:
                end, self.stopped = min(end, i), True
        if not (final or self.stopped):
            end = max(0, end - self.keep)
        out, self.held = self.held[:end], self.held[end:]
        return out
