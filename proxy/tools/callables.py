"""Python callables as proxy tools (``[tools.<name>] callables = ["module:function"]``).

For sidecar deployments: the proxy imports each function when it starts, describes it
as a model's tool from its signature (:func:`flowlift.tool_schema.function_schema`:
pydantic, the docstring as the description) and calls it with the arguments validated
into its annotated types (``pydantic.validate_call``). An ``async def`` runs on the
proxy's event loop (it must not block); a plain function runs in a worker thread
(``asyncio.to_thread``): a timed-out plain function is abandoned, not stopped (Python
cannot kill a thread), so long-blocking work belongs in an MCP server.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError, validate_call

from flowlift.errors import ConfigError
from flowlift.proxy.tools.outcome import ServerTool, ToolOutcome
from flowlift.tool_schema import NoSchema, function_schema


def load_callable(path: str, field: str) -> Callable[..., Any]:
    """The function ``module:function`` names.

    Raises:
        ConfigError: the module does not import, has no such attribute, or it is not
            callable (``field`` names the config key).
    """
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(f"{field}: cannot import module {module_name!r} of {path!r} "
                          f"({type(exc).__name__}: {exc})", param=field) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{field}: module {module_name!r} has no function {attr!r}",
                          param=field)
    return fn  # type: ignore[no-any-return]


class CallableServer:
    """The callables of one ``[tools.<name>]``, by their function names.

    Args:
        name: the server's name (for messages).
        paths: its ``callables`` (``module:function``).

    Raises:
        ConfigError: a path does not load, two functions share a name, or a function's
            arguments have no JSON Schema.
    """

    def __init__(self, name: str, paths: Sequence[str]) -> None:
        self._fns: dict[str, Callable[..., Any]] = {}
        self._async: set[str] = set()
        self._tools: dict[str, ServerTool] = {}
        field = f"tools.{name}.callables"
        for path in paths:
            fn = load_callable(path, field)
            tool = getattr(fn, "__name__", path.rpartition(":")[2])
            if tool in self._fns:
                raise ConfigError(f"{field}: two callables are named {tool!r}", param=field)
            try:
                schema = function_schema(fn)
            except NoSchema as exc:
                raise ConfigError(f"{field}: {path}: {exc}", param=field) from None
            self._fns[tool] = validate_call(fn)
            if inspect.iscoroutinefunction(fn):
                self._async.add(tool)
            self._tools[tool] = ServerTool(tool, inspect.getdoc(fn) or "", schema)

    async def tools(self) -> dict[str, ServerTool]:
        return dict(self._tools)

    async def call(self, name: str, args: dict[str, Any]) -> ToolOutcome:
        fn = self._fns[name]
        try:
            if name in self._async:
                return ToolOutcome(await fn(**args))
            return ToolOutcome(await asyncio.to_thread(fn, **args))
        except ValidationError as exc:
            return ToolOutcome(error=f"bad arguments: {exc.errors(include_url=False)}")
        except Exception as exc:
            return ToolOutcome(error=f"{type(exc).__name__}: {exc}")

    async def aclose(self) -> None:
        return None
