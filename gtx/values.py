"""Command-line strings to typed values, for pattern parameters and ``--set`` settings alike."""

BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def parse_scalar(raw: str, typ: type) -> object:
    """``raw`` as ``typ`` (int, float, bool or str); raises ValueError when it does not parse."""
    if typ is bool:
        if raw.lower() not in BOOLS:
            raise ValueError(raw)
        return BOOLS[raw.lower()]
    return typ(raw)
