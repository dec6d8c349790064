"""The tools and environments of tool episodes (grpo.tools, grpo.environment; TRL's tools= and
environment_factory=), and running one turn's calls.

`ToolUse` is built once from the config: the standalone tools, and the environment classes by name. For a batch
of prompt rows it hands out one `Toolbox` per episode: the row's environment instance (pooled: an instance is
reset for its next episode rather than built again, as TRL does), reset with the row's columns, and the tools the
episode may call (the standalone ones, then the environment's public methods).

`run_turns` runs every episode's calls of one turn, the episodes side by side and each episode's calls in order.
Whatever happens, the model gets an answer: a tool that raises answers `{'error': '<message>'}` (TRL's text), one
that runs past the timeout answers a timeout error, a name the model invented answers `Tool <name> not found.`;
each is counted as a failure, and the run goes on. A sync tool that hangs is left running on its daemon thread
(Python cannot stop a thread); an async one is cancelled.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from rlhf_core.config import GRPOConfig, UserError
from rlhf_core.config.loading import import_object
from rlhf_core.data.tool_calls import tool_template_problem

ENVIRONMENT_COLUMN = "environment"  # the prompt column that picks a row's environment (TRL's)
MAX_PARALLEL_EPISODES = 32


class ToolError(UserError):
    """A tool or environment that cannot be used; the message is one sentence naming the config field."""


@dataclass(frozen=True)
class ToolAnswer:
    name: str
    content: str
    failed: bool


@dataclass
class Toolbox:
    """What one episode may call: name -> callable, and its environment instance (None without one)."""

    tools: dict[str, Callable] = field(default_factory=dict)
    environment: object | None = None
    reset_text: str | None = None  # what reset(**row) returned: appended to the prompt's last user message

    def schemas(self) -> list[Callable]:
        """The tools as the chat template receives them (transformers reads their hints and docstrings)."""
        return list(self.tools.values())


class _AsyncRunner:
    """One event loop on a daemon thread, for the async tools of the process."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="tool-event-loop", daemon=True).start()

    def run(self, coroutine, timeout_s: float):
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coroutine, timeout_s), self.loop)
        return future.result(timeout_s + 1.0)  # a coroutine that blocks the loop itself cannot be cancelled


_ASYNC: list[_AsyncRunner] = []


def _async_runner() -> _AsyncRunner:
    if not _ASYNC:
        _ASYNC.append(_AsyncRunner())
    return _ASYNC[0]


def _run_sync(fn: Callable, arguments: dict, timeout_s: float):
    """fn(**arguments) on a daemon thread; TimeoutError when it has not returned within timeout_s."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn(**arguments)
        except BaseException as err:  # handed to the caller, who answers the model with it
            box["error"] = err

    thread = threading.Thread(target=target, name="tool-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"the tool did not answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def call_tool(toolbox: Toolbox, call: dict, timeout_s: float) -> ToolAnswer:
    """One call {"type": "function", "function": {"name", "arguments"}} answered; never raises."""
    function = call.get("function", {}) if call.get("type", "function") == "function" else None
    if function is None:
        return ToolAnswer(
            call.get("name", "unknown"), str({"error": f"Unsupported tool call type: {call['type']}"}), True
        )
    name = function.get("name", "unknown")
    try:
        fn = toolbox.tools.get(name)
        if fn is None:
            raise ValueError(f"Tool {name} not found.")
        arguments = function.get("arguments") or {}
        if inspect.iscoroutinefunction(fn):
            result = _async_runner().run(fn(**arguments), timeout_s)
        else:
            result = _run_sync(fn, arguments, timeout_s)
    except TimeoutError:
        return ToolAnswer(name, str({"error": f"Tool {name} timed out after {timeout_s:g} s"}), True)
    except Exception as err:
        return ToolAnswer(name, str({"error": str(err)}), True)
    return ToolAnswer(name, str(result), False)


def run_turns(jobs: Sequence[tuple[Toolbox, list[dict]]], timeout_s: float) -> list[list[ToolAnswer]]:
    """Every episode's calls of one turn: episodes in parallel, each episode's calls in order."""
    if not jobs:
        return []

    def one(job: tuple[Toolbox, list[dict]]) -> list[ToolAnswer]:
        toolbox, calls = job
        return [call_tool(toolbox, call, timeout_s) for call in calls]

    with ThreadPoolExecutor(min(MAX_PARALLEL_EPISODES, len(jobs)), thread_name_prefix="tool-episode") as pool:
        return list(pool.map(one, jobs))


def public_methods(instance) -> list[Callable]:
    """An environment's tools: its public methods other than reset and get_reward (listed on the class, so that
    properties are not evaluated), bound to the instance."""
    names = [n for n, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)]
    return [getattr(instance, n) for n in names if not n.startswith("_") and n not in ("reset", "get_reward")]


@dataclass
class ToolUse:
    """grpo.tools and grpo.environment, imported: hands each episode its Toolbox."""

    tools: list[Callable]
    environments: dict[str | None, type] = field(default_factory=dict)
    max_calls: int | None = None
    timeout_s: float = 10.0
    pool: dict[str | None, list] = field(default_factory=dict)

    @property
    def multi_environment(self) -> bool:
        return bool(self.environments) and None not in self.environments

    def environment_name(self, row: dict, index: int) -> str | None:
        if not self.multi_environment:
            return None
        name = row.get(ENVIRONMENT_COLUMN)
        if name not in self.environments:
            raise ToolError(
                f"prompt row {index}: its `{ENVIRONMENT_COLUMN}` column is {name!r}, not one of grpo.environment's "
                f"names ({', '.join(sorted(map(str, self.environments)))})"
            )
        return name

    def toolboxes(self, rows: Sequence[dict]) -> list[Toolbox]:
        """One Toolbox per row (a GRPO group's rows each get their own), environments reset with the row."""
        taken: dict[str | None, int] = {}
        boxes = []
        for i, row in enumerate(rows):
            tools = {fn.__name__: fn for fn in self.tools}
            if not self.environments:
                boxes.append(Toolbox(tools))
                continue
            name = self.environment_name(row, i)
            instances = self.pool.setdefault(name, [])
            slot = taken.get(name, 0)
            taken[name] = slot + 1
            if slot == len(instances):
                instances.append(self.environments[name]())
            instance = instances[slot]
            columns = {k: v for k, v in row.items() if k not in ("prompt", "prompt_messages")}
            text = instance.reset(**columns)
            tools.update({fn.__name__: fn for fn in public_methods(instance)})
            boxes.append(Toolbox(tools, instance, text if isinstance(text, str) and text else None))
        return boxes

    def reward_classes(self) -> list[type]:
        """The environment classes that score their episodes (get_reward), each once."""
        out: list[type] = []
        for cls in self.environments.values():
            if callable(getattr(cls, "get_reward", None)) and cls not in out:
                out.append(cls)
        return out


def load_tool_use(grpo: GRPOConfig) -> ToolUse | None:
    """The configured tools and environments, imported and checked; None when the config has neither."""
    if not grpo.uses_tools:
        return None
    tools = []
    for i, spec in enumerate(grpo.tools):
        fn = import_object(spec, field=f"grpo.tools[{i}]", error=ToolError)
        if inspect.isclass(fn):
            raise ToolError(
                f"grpo.tools[{i}]: '{spec}' is a class; name a function, or give the class as grpo.environment"
            )
        tools.append(fn)
    names = [fn.__name__ for fn in tools]
    if len(set(names)) < len(names):
        raise ToolError(f"grpo.tools: two tools share the name {sorted(n for n in names if names.count(n) > 1)[0]!r}")
    specs = grpo.environment if isinstance(grpo.environment, dict) else {None: grpo.environment}
    environments = {}
    for name, spec in specs.items():
        if spec is None:
            continue
        where = "grpo.environment" if name is None else f"grpo.environment.{name}"
        cls = import_object(spec, field=where, error=ToolError, what="class")
        if not callable(getattr(cls, "reset", None)):
            raise ToolError(f"{where}: '{spec}' has no reset method; an environment must define reset(**row)")
        environments[name] = cls
    return ToolUse(tools, environments, grpo.max_tool_calls, grpo.tool_timeout_s)


def require_tool_template(tokenizer, template_kwargs: dict | None = None) -> None:
    """Refuse, in one sentence naming the template, a tokenizer whose chat template cannot carry tool episodes
    (`tool_template_problem`): checked when the data stage loads the tokenizer, before any training."""
    problem = tool_template_problem(tokenizer, template_kwargs)
    if problem is not None:
        raise ToolError(f"grpo.tools and grpo.environment need a chat template that writes tool turns, and {problem}")
