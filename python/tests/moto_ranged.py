"""moto's S3 server (``moto_server``, same arguments) with ranged GETs that read only the range.

moto 5.2 answers ``GET`` with ``Range: bytes=a-b`` by reading the whole object out of its
spooled temporary file and slicing it: ~165 ms per range of a 270 MB SmolLM2 checkpoint on the
2-core CI machine, whatever the range's size, and mx reads artifacts in hundreds of ranges (a
delta export reads its base tensor by tensor; a tp:3 worker stages its slices). Here such a GET
reads the range alone (seek, read), under the key's lock as moto does; everything else, and
every answer's bytes, headers and errors, are moto's own. scripts/test.sh points the tests at
it (``MX_MOTO_SERVER``, read by ``mx_harness::s3`` and python/tests/test_artifact.py); when
moto's internals differ from what this expects, it serves as plain moto.

    python moto_ranged.py -H 127.0.0.1 -p PORT
"""

from __future__ import annotations

import sys
import threading


def _patch() -> bool:
    """Installs the ranged read; False (moto unchanged) when moto is not the expected shape."""
    try:
        from moto.s3.models import FakeKey
        from moto.s3.responses import S3Response
    except ImportError:
        return False
    value = FakeKey.__dict__.get("value")
    if not isinstance(value, property) or not hasattr(S3Response, "key_response"):
        return False
    lazy = threading.local()

    class RangedValue:
        """A key's bytes as moto's range handler uses them: ``len()`` and one slice."""

        def __init__(self, key: FakeKey) -> None:
            self.key = key

        def __len__(self) -> int:
            return int(self.key.contentsize)

        def __bool__(self) -> bool:
            return len(self) > 0

        def __getitem__(self, s: slice) -> bytes:
            start, stop, step = s.indices(len(self))
            if step != 1:
                return self.whole()[s]
            with self.key.lock:
                buf = self.key._value_buffer
                buf.seek(start)
                return buf.read(max(0, stop - start))

        def whole(self) -> bytes:
            return value.fget(self.key)

    def get_value(self: FakeKey) -> object:
        if getattr(lazy, "on", False) and hasattr(self, "_value_buffer"):
            return RangedValue(self)
        return value.fget(self)

    FakeKey.value = property(get_value, value.fset)
    key_response = S3Response.key_response

    def ranged_key_response(self, request, full_url, headers):  # type: ignore[no-untyped-def]
        rng = request.headers.get("range", "") if request.method == "GET" else ""
        lazy.on = rng.startswith("bytes=") and "," not in rng
        try:
            status, out_headers, body = key_response(self, request, full_url, headers)
        finally:
            lazy.on = False
        if isinstance(body, RangedValue):  # not sliced (moto answered the whole object)
            body = body.whole()
        return status, out_headers, body

    S3Response.key_response = ranged_key_response
    return True


if __name__ == "__main__":
    _patch()
    from moto.server import main

    main(sys.argv[1:])
