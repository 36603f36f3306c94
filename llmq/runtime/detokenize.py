"""A sequence's output text, decoded a few tokens at a time.

Decoding the whole output again at every step costs time linear in its length, so a long generation's steps grow
slower and a stream's total work grows with the square of its length (~0.07 ms a step at 128 tokens on the default
model, 0.5 ms at 1,000; per sequence, on the engine thread). Here each step decodes only a window: the tokens since
the last settled point, with the token before them as context (a tokenizer may drop or add a leading space at the
start of what it decodes, so the window's text is compared against the same window's text without the new tokens,
and only the difference is appended). A window that ends inside a character (byte-level tokens split a UTF-8 sequence:
the text ends with U+FFFD) is held back until the character is complete, or the sequence finishes.
"""

from __future__ import annotations


class IncrementalText:
    """token_ids[start:] as text; `update` after every appended token. skip_special: leave special tokens out (a
    chat format whose markers are special tokens keeps them, to read its tool calls)."""

    def __init__(self, start: int, skip_special: bool = True):
        self.skip_special = skip_special
        self.text = ""
        self.prefix = start  # the window's first token: context for the tokens after `read`
        self.read = start  # tokens before this one are in self.text

    def update(self, tokenizer, token_ids: list[int], end: int, final: bool) -> str:
        """The text of token_ids[start:end]; while not final it leaves out an unfinished trailing character."""
        if end <= self.read:
            return self.text
        head = tokenizer.decode(token_ids[self.prefix:self.read], skip_special_tokens=self.skip_special)
        window = tokenizer.decode(token_ids[self.prefix:end], skip_special_tokens=self.skip_special)
        if not final and (window.endswith("\ufffd") or len(window) <= len(head)):
            return self.text
        self.text += window[len(head):]
        self.prefix, self.read = self.read, end
        return self.text
