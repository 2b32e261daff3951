from typing import Any

def data(a: Any) -> int: ...

class Fit:
    def __init__(
        self,
        x: Any,
        xw: bool,
        o: Any,
        go: Any,
        res: Any,
        call: Any,
        tid: int,
        weak: bool = False,
        ret: int = 0,
        kind: bool = False,
        own: int = -1,
    ) -> None: ...

class Entry:
    def __init__(
        self,
        slow: Any,
        plans: dict[Any, Any],
        fam: Any,
        engine: Any,
        p2p: Any,
        enter: Any,
        leave: Any,
        append: Any,
        enabled: Any,
        trace: int,
        fail: Any,
        overlapped: Any,
        ndarray: type,
        owner: Any,
        weak: dict[Any, Any],
        kinds: dict[Any, Any],
    ) -> None: ...
    def __call__(self, *args: Any) -> Any: ...
    def forget(self) -> None: ...
