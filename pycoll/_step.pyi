from typing import Any

def reduce(op: int, kind: int, out: Any, count: int, rows: tuple[int, ...]) -> bool: ...
def stream_copy(dst: int, src: int, nbytes: int) -> None: ...
def copy(dst: Any, src: Any) -> None: ...
def reduction_by_address(*args: Any) -> tuple[int, int, int, int, int]: ...
def broadcast_by_address(*args: Any) -> tuple[int, int, int, int, int]: ...
def allgather_by_address(*args: Any) -> tuple[int, int, int, int, int]: ...

class Step:
    def __init__(
        self,
        mode: int,
        group: Any,
        claim: Any,
        wait: Any,
        reduce: Any,
        K: int,
        kd: int,
        small: bool,
        mul: int,
        mask: int,
        fpw: int,
        spins: int,
        nbytes: int,
        count: int,
        op: int,
        kind: int,
        slot: tuple[int, ...],
        word: tuple[int, ...],
        done: int,
        theirs: tuple[tuple[int, ...], ...],
        rows: tuple[tuple[int, ...], ...],
        dones: tuple[int, ...],
        ahead: int,
        piece: int,
        yield_ns: int,
    ) -> None: ...
    def __call__(self, x: Any, out: Any) -> None: ...
