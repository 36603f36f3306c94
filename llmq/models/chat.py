"""Rendering a tokenizer's chat template, bounded. A template is code from whoever published the model: Jinja's
sandbox keeps it from the host, but not from looping for ever, building a string of gigabytes in one operation or
recursing until the traceback fills a screen. A Python thread cannot be stopped and a single C-level operation
cannot be interrupted, so the render runs in a forked child with an address-space limit and a deadline, killed
when it passes; every failure is one line. Calibration forks one child for a whole set (render_chats); a server
keeps one child for its life (RenderWorker), since each fork of a large process holds the interpreter while the
kernel copies its page tables."""

from __future__ import annotations

import os
import pickle
import resource
import select
import signal
import struct
import threading
import time

from ..errors import LlmqError

RENDER_SECONDS = 10.0  # a real template renders in milliseconds
RENDER_BYTES = 512 << 20  # memory a render may allocate beyond what the process already maps
RENDER_CHARS = 64 << 20  # longest rendered text


class TemplateError(LlmqError):
    """A chat template render that ran past its deadline or its memory (the child was killed)."""


def render_chats(tokenizer, chats: list[tuple[list[dict], dict]], max_chars: int = RENDER_CHARS
                 ) -> list[tuple[str, str]]:
    """Many conversations (messages, apply_chat_template's keyword arguments) rendered in one child within the same
    bounds, all together (a calibration set forks once, not once a conversation): ("ok", text), or ("rejected" /
    "failed", one line) each; TemplateError when the child passes its deadline or memory."""
    seconds = RENDER_SECONDS
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: render, send [(kind, text or message)], exit without running the parent's cleanup
        try:
            os.close(r)
            _limit_memory(RENDER_BYTES)
            _write_all(w, _frame(pickle.dumps([_render(tokenizer, m, max_chars, kw) for m, kw in chats])))
        finally:
            os._exit(0)
    os.close(w)
    try:
        data = _read_frame(r, time.monotonic() + seconds)
    finally:
        os.close(r)
        _kill(pid)
    if data is None:
        raise TemplateError(f"the chat template did not finish within {seconds:g} s")
    if not data:  # the child died mid-answer (killed for memory)
        raise TemplateError(f"the chat template needed more than {RENDER_BYTES >> 20} MiB")
    return pickle.loads(data)


class RenderWorker:
    """One long-lived forked child that renders conversations for a server, each within the deadline and memory
    bounds; a render that passes them kills the child, and the next render forks a fresh one. Renders are taken one
    at a time. The template is sent with each render, so the child renders what the tokenizer holds now."""

    def __init__(self, tokenizer, max_chars: int = RENDER_CHARS):
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        self.lock = threading.Lock()
        self.child: tuple[int, int, int] | None = None  # pid, request fd, answer fd

    def render(self, messages: list[dict], **kwargs) -> tuple[str, str]:
        """("ok", text) or ("rejected" / "failed", one line), as render_chats; TemplateError when the child passed
        its deadline or memory (it is gone; the next render starts another)."""
        kwargs = {"chat_template": self.tokenizer.chat_template, **kwargs}
        with self.lock:
            pid, req, ans = self.child = self.child or self._fork()
            try:
                _write_all(req, _frame(pickle.dumps((messages, kwargs))))
                data = _read_frame(ans, time.monotonic() + RENDER_SECONDS)
            except OSError:
                data = b""
            if data is None or not data:
                self._drop()
            if data is None:
                raise TemplateError(f"the chat template did not finish within {RENDER_SECONDS:g} s")
            if not data:  # the child died mid-answer (killed for memory)
                raise TemplateError(f"the chat template needed more than {RENDER_BYTES >> 20} MiB")
            return pickle.loads(data)

    def close(self) -> None:
        """End the child (after the render in progress, if any)."""
        with self.lock:
            self._drop()

    def _drop(self) -> None:
        if self.child is not None:
            pid, req, ans = self.child
            self.child = None
            os.close(req)
            os.close(ans)
            _kill(pid)

    def _fork(self) -> tuple[int, int, int]:
        req_r, req_w = os.pipe()
        ans_r, ans_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: answer each framed request until the server closes the pipe
            try:
                os.close(req_w)
                os.close(ans_r)
                _limit_memory(RENDER_BYTES)
                while (data := _read_frame(req_r, None)):
                    messages, kwargs = pickle.loads(data)
                    _write_all(ans_w, _frame(pickle.dumps(_render(self.tokenizer, messages, self.max_chars,
                                                                  kwargs))))
            finally:
                os._exit(0)
        os.close(req_r)
        os.close(ans_w)
        return pid, req_w, ans_r


def _frame(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _read_frame(fd: int, deadline: float | None) -> bytes | None:
    """One length-prefixed message; b"" when the writer closed the pipe first, None when the deadline passed."""
    head = _read_exactly(fd, 8, deadline)
    if not head:
        return head
    return _read_exactly(fd, struct.unpack("<Q", head)[0], deadline)


def _read_exactly(fd: int, n: int, deadline: float | None) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return b""
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _render(tokenizer, messages: list[dict], max_chars: int, kwargs: dict) -> tuple[str, str]:
    """("ok", text), or ("rejected" / "failed", one line)."""
    from jinja2 import TemplateError as JinjaError

    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except MemoryError:
        return "failed", f"the chat template needed more than {RENDER_BYTES >> 20} MiB"
    except RecursionError:
        return "failed", "the chat template recursed too deeply"
    except Exception as e:
        line = (str(e).splitlines() or [""])[0][:300]
        return ("rejected", line) if isinstance(e, JinjaError) else ("failed", f"{type(e).__name__}: {line}")
    if not isinstance(text, str):
        return "failed", f"the chat template rendered a {type(text).__name__}, not text"
    if len(text) > max_chars:
        return "failed", f"the chat template rendered {len(text):,} characters, more than {max_chars:,}"
    return "ok", text


def _limit_memory(extra: int) -> None:
    """Cap the address space at what is mapped now plus `extra` bytes."""
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + extra, mapped + extra))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
