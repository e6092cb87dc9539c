"""config.pbtxt parameters: typed from their strings, unknown names refused; no torch here,
so the router (which has no engine) reads its parameters without loading it."""
from __future__ import annotations


def typed_parameter(name: str, text: str, default):
    """A config.pbtxt string as the type of its default; a bad value names the parameter."""
    text = text.strip()
    if isinstance(default, bool):
        if text.lower() not in ("true", "false"):
            raise ValueError(f"parameter {name!r} must be true or false, got {text!r}")
        return text.lower() == "true"
    try:
        return type(default)(text)
    except ValueError:
        raise ValueError(f"parameter {name!r} must be {'an' if type(default) is int else 'a'} "
                         f"{type(default).__name__}, got {text!r}") from None


def refuse_unknown(params: dict[str, str], known, model: str) -> None:
    """A misspelt knob would silently keep its default: refuse it at load, by name."""
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(f"{model}: unknown parameter{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown))} in config.pbtxt (known: {', '.join(sorted(known))})")
