"""Token ids to streamed text: safe across multi-byte characters, with OpenAI stop strings."""


class Detokenizer:
    """Decode the whole output each time and emit only the new suffix; hold back a half character (U+FFFD)."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0          # characters already emitted
        self.stopped = False   # a stop string was seen: emit nothing more

    def add(self, token: int | None, final: bool = False) -> str:
        if token is not None:
            self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            i = text.find(s)
            if i >= 0:
                text, self.stopped = text[:i], True
        if not (final or self.stopped):
            if text.endswith("\ufffd"):
                return ""
            hold = max((len(s) - 1 for s in self.stop), default=0)  # a stop string may be starting here
            text = text[:max(self.sent, len(text) - hold)]
        out, self.sent = text[self.sent:], max(self.sent, len(text))
        return out
