from typing import Any

def post_wait(
    x: Any,
    slot: int,
    nbytes: int,
    done: int,
    done_value: int,
    posted: int,
    word: int,
    peers: tuple[int, ...],
    spins: int,
) -> int: ...
def reduce(op: int, kind: int, out: Any, count: int, rows: tuple[int, ...]) -> bool: ...
def store(addr: int, value: int) -> None: ...
def wait(peers: tuple[int, ...], word: int, spins: int) -> int: ...
def copy_blocks(out: Any, block: int, sources: tuple[int, ...]) -> None: ...
