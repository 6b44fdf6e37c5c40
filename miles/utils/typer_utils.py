"""Miles's ``miles.utils.typer_utils.dataclass_cli``: a function of one dataclass becomes a typer command.

Each field of the dataclass becomes an option (``--model-name``, ``--num-gpus-per-node``, ...) whose default
is the field's, also read from the environment variable ``<prefix><FIELD>`` (``MILES_SCRIPT_MODEL_NAME``);
a field's ``metadata["help"]`` is its help text. The command builds the dataclass from the options (so its
``__post_init__`` runs), prints the values, and calls the function with it. Miles's launchers use it as
``@app.command() @U.dataclass_cli def train(args: ScriptArgs)`` or ``typer.run(U.dataclass_cli(main))``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])


def dataclass_cli(func: _F | None = None, *, env_var_prefix: str = "MILES_SCRIPT_") -> Any:
    """Wrap ``func(args: SomeDataclass)`` for typer; usable bare or as ``dataclass_cli(env_var_prefix="")``."""
    if func is None:
        return functools.partial(dataclass_cli, env_var_prefix=env_var_prefix)
    return _wrap(func, env_var_prefix)


def _wrap(func: Callable[..., Any], env_var_prefix: str) -> Callable[..., Any]:
    import typer  # a dependency of transformers, so always there; imported only when a launcher needs it

    first = next(iter(inspect.signature(func).parameters))
    cls = typing.get_type_hints(func)[first]
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"dataclass_cli: the first parameter of {func.__name__} must be annotated with a dataclass")
    hints = typing.get_type_hints(cls)
    params = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        option: dict[str, Any] = {}
        if env_var_prefix:
            option["envvar"] = f"{env_var_prefix}{f.name.upper()}"
        if "help" in f.metadata:
            option["help"] = f.metadata["help"]
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = inspect.Parameter.empty
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=Annotated[hints.get(f.name, Any), typer.Option(**option)]))

    @functools.wraps(func)
    def command(**kwargs: Any) -> Any:
        args = cls(**kwargs)
        width = max((len(f.name) for f in dataclasses.fields(args)), default=0)
        for f in dataclasses.fields(args):
            value = str(getattr(args, f.name))
            print(f"  {f.name:<{width}} = {value if len(value) <= 100 else value[:97] + '...'}")
        return func(args)

    del command.__wrapped__  # typer must see the options below, not func's one dataclass parameter
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return command
