"""Token ids to streamed text: incremental (each token decodes a short window, not the whole output), safe across
multi-byte characters (a window ending in U+FFFD waits for the next token), with OpenAI stop strings."""


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []
        self.prefix = self.read = 0   # ids[prefix:read] were decoded already; they give context to the next piece
        self.text = ""                # everything decoded so far
        self.sent = 0                 # characters of self.text already emitted
        self.stopped = False          # a stop string was seen: emit nothing more

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int | None, final: bool = False) -> str:
        """Feed one token (or None); return the text that may be emitted now."""
        if self.stopped:
            return ""
        if token is not None:
            self.ids.append(token)
            before = self._decode(self.ids[self.prefix:self.read])
            after = self._decode(self.ids[self.prefix:])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                self.text += after[len(before):]
                self.prefix, self.read = self.read, len(self.ids)
        end = len(self.text)
        for s in self.stop:
            i = self.text.find(s, max(0, self.sent - len(s)))
            if i >= 0:
                end, self.stopped = min(end, i), True
        if not (final or self.stopped):
            end = max(self.sent, end - max((len(s) - 1 for s in self.stop), default=0))  # a stop may be starting
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out
