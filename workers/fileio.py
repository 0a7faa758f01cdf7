"""Whole-file preadv/pwritev for page files, including O_DIRECT's short-transfer rule.

Owns "move exactly these bytes, or say how many moved": continuing after a
short read or write (network filesystems return them), and leaving O_DIRECT
for the tail of a transfer that stopped off a block boundary; and cutting a
buffered write into pieces (`pieces`), between which a worker may pause it.
Must not open or name files, or judge their contents, nor decide when a
write pauses: `workers.worker` does that.
"""
import fcntl
import os

from workers import directio


def preadv_full(fd: int, iovecs: list, total: int, direct: bool = False, offset: int = 0) -> int:
    """preadv until `total` bytes or EOF (network filesystems may return short).

    With O_DIRECT a continuation must start on a block boundary; after an
    unaligned short read (a file whose length is not a block multiple: EOF,
    in practice) O_DIRECT is cleared on the descriptor and the rest is read
    buffered, rather than failing with EINVAL.
    """
    got = os.preadv(fd, iovecs, offset)
    while 0 < got < total:
        if direct and not directio.aligned(got):
            clear_direct(fd)
            direct = False
        rest = skip(iovecs, got)
        n = os.preadv(fd, rest, offset + got)
        if n == 0:
            break
        got += n
    return got


# A buffered page write goes in pieces of about this many bytes: the finest a
# worker can pause it for reads (decision 66). About 0.3 ms of copy
# into the page cache; a piece costs one more pwritev and a gate check.
WRITE_PIECE_BYTES = 1 << 20


def pwritev_full(fd: int, iovecs: list, direct: bool = False, offset: int = 0) -> None:
    total = sum(len(v) for v in iovecs)
    done = os.pwritev(fd, iovecs, offset)
    while done < total:
        if direct and not directio.aligned(done):
            clear_direct(fd)  # as in preadv_full: finish an odd short write buffered
            direct = False
        done += os.pwritev(fd, skip(iovecs, done), offset + done)


def pieces(iovecs: list, size: int = WRITE_PIECE_BYTES) -> list[list]:
    """The iovecs cut, in order, into runs of `size` bytes (the last may be
    shorter); an iovec crossing a boundary is split into memoryview slices."""
    out, cur, room = [], [], size
    for v in iovecs:
        mv = memoryview(v)
        while len(mv):
            take = mv[:room]
            cur.append(take)
            mv = mv[len(take):]
            room -= len(take)
            if room == 0:
                out.append(cur)
                cur, room = [], size
    if cur:
        out.append(cur)
    return out


def clear_direct(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~directio.O_DIRECT)


def skip(iovecs: list, nbytes: int) -> list:
    """The iovecs left after the first `nbytes` bytes."""
    out = []
    for v in iovecs:
        mv = memoryview(v)
        if nbytes >= len(mv):
            nbytes -= len(mv)
            continue
        out.append(mv[nbytes:])
        nbytes = 0
    return out


def split(iovecs: list, nbytes: int) -> tuple[list, list]:
    """The iovecs cut after `nbytes` bytes: (the first `nbytes`, the rest); an
    iovec crossing the cut is split into memoryview slices."""
    head, room = [], nbytes
    for i, v in enumerate(iovecs):
        if room == 0:
            return head, list(iovecs[i:])
        mv = memoryview(v)
        if len(mv) <= room:
            head.append(mv)
            room -= len(mv)
            continue
        return head + [mv[:room]], [mv[room:]] + list(iovecs[i + 1:])
    return head, []
