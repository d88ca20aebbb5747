"""The store's one read path: a blob file's content, decoded, hashed, counted and checked against its digest.

Every reader of a blob file goes through here (a get, a copy, the commit
of a download that arrived compressed, ``verify``, a rebuild identifying
files), so what counts as damage is decided once:

* proof of damage, :data:`DAMAGE`: content that does not hash to its digest
  or has another size, a file of another size than recorded, a compressed
  file the codec refuses (:class:`ChecksumMismatch`); something other than
  a regular file where the blob should be (:class:`NotABlobFile`).  Only
  these may quarantine a blob.
* no file: :class:`BlobMissing`.
* anything else the system says while opening or reading (EMFILE, ENFILE,
  ENOMEM, EIO, EACCES, ...): :class:`BlobUnreadable` with its errno.  The
  file may be whole, so the blob stays and the next read may succeed.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Generator, Iterator
from contextlib import closing, contextmanager

from .codec import Damaged, Encoding, decode_file, decode_whole
from .errors import BlobMissing, BlobUnreadable, ChecksumMismatch, NotABlobFile

__all__ = ["DAMAGE", "VerifiedRead", "open_blob", "CHUNK_SIZE"]

#: Bytes per read of a raw file (a chunk of :meth:`VerifiedRead.chunks`).
CHUNK_SIZE = 4 << 20

#: The errors that prove a blob damaged: the only ones after which it is quarantined.
DAMAGE = (ChecksumMismatch, NotABlobFile)


def open_blob(path: str | os.PathLike[str], digest: str) -> int:
    """A descriptor of the blob file ``path``, opened without following a symlink (invariant 10).

    ``O_NONBLOCK``: a FIFO put where a blob should be is refused, not waited
    on.  :class:`NotABlobFile` for a symlink or anything but a regular
    file, :class:`BlobMissing` for no file, :class:`BlobUnreadable` else.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        raise BlobMissing(digest, "file missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotABlobFile(digest, "file is a symlink (never followed)") from None
        raise _unreadable(digest, exc) from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        raise _unreadable(digest, exc) from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotABlobFile(digest, f"file is not a regular file (mode {stat.filemode(mode)})")
    return fd


def _unreadable(digest: str, exc: OSError) -> BlobUnreadable:
    return BlobUnreadable(digest, exc.errno, exc.strerror or str(exc))


class VerifiedRead:
    """One read of the blob file open at ``fd``: its content, checked against ``digest`` as it is read.

    ``encoding``: how the file holds the content.  ``size``: the content
    size recorded (None: whatever the file holds, for a file found without
    a row); ``stored``: the file size recorded, checked before a byte is
    read.  Use :meth:`chunks` (streamed) or :meth:`whole` (one ``bytes``,
    the content held once), once.  The check raises at the end, after the
    last chunk; :attr:`size` counts the content bytes read so far.
    """

    def __init__(
        self, fd: int, digest: str, *, encoding: Encoding, size: int | None, stored: int | None = None
    ) -> None:
        self._fd = fd
        self.digest = digest
        self._encoding = encoding
        self._expected = size
        self._stored = stored
        self._sha = hashlib.sha256()
        self.size = 0

    def chunks(self) -> Iterator[bytes]:
        """The content in chunks (one per frame, or :data:`CHUNK_SIZE` of a raw file), verified at the end."""
        with self._reading():
            self._check_stored()
            source = (
                decode_file(self._fd, self._expected)
                if self._encoding is Encoding.ZSTD
                else _raw_chunks(self._fd, self._expected)
            )
            with closing(source):  # closed here, before the caller closes the file: the helper stops reading it
                for chunk in source:
                    self._sha.update(chunk)
                    self.size += len(chunk)
                    yield chunk
        self._check()

    def whole(self) -> bytes:
        """The whole content, verified: held once (a compressed file is decoded into the buffer returned)."""
        if self._expected is None:
            return b"".join(self.chunks())
        with self._reading():
            self._check_stored()
            if self._encoding is Encoding.ZSTD:
                data = decode_whole(self._fd, self._expected)
            else:
                data = _raw_whole(self._fd, self._expected)
        self._sha.update(data)
        self.size = len(data)
        self._check()
        return data

    @contextmanager
    def _reading(self) -> Iterator[None]:
        """The codec's refusal is damage; the system's errors are not."""
        try:
            yield
        except Damaged as exc:
            raise ChecksumMismatch(self.digest, f"(a damaged frame: {exc})", self.size) from None
        except OSError as exc:
            raise _unreadable(self.digest, exc) from None

    def _check_stored(self) -> None:
        if self._stored is not None:
            actual = os.fstat(self._fd).st_size
            if actual != self._stored:
                raise ChecksumMismatch(self.digest, f"(a file of {actual} bytes, {self._stored} recorded)", 0)

    def _check(self) -> None:
        got = self._sha.hexdigest()
        if got != self.digest or (self._expected is not None and self.size != self._expected):
            raise ChecksumMismatch(self.digest, got, self.size)


def _raw_chunks(fd: int, size: int | None, offset: int = 0) -> Generator[bytes, None, None]:
    """A raw file's bytes from ``offset``; with ``size``, up to one byte past it (enough to tell it is longer)."""
    limit = None if size is None else size + 1
    while limit is None or offset < limit:
        chunk = os.pread(fd, CHUNK_SIZE if limit is None else min(CHUNK_SIZE, limit - offset), offset)
        if not chunk:
            return
        offset += len(chunk)
        yield chunk


def _raw_whole(fd: int, size: int) -> bytes:
    """A raw file of ``size`` bytes in one ``bytes``, in one read (up to one byte more, to tell it is longer)."""
    data = os.pread(fd, size + 1, 0)
    if len(data) <= size and len(data) < os.fstat(fd).st_size:  # cut short (one pread stops short of 2 GiB)
        return data + b"".join(_raw_chunks(fd, size, len(data)))
    return data
