"""Does "auto"'s measured write bandwidth match what a shaped link in front of moto carries?

    python -m benchmarks.auto_link_check [RATE_BYTES_PER_S]     # default 40e6

Saves a 48 MiB trained state raw, compressed, raw, compressed through a link of RATE (5 ms a
request) and prints, after each save, the raw and coded write figures this process measured
(`cairn._storage.measured`) and the codec factor, then the link's own count of bytes and busy
seconds, to compare against.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import cairn
from _shapedlink import ShapedLink
from benchmarks.bench_objstore import start
from benchmarks.trained_state import make_state
from cairn._save.options import CODEC_METER
from cairn._storage.location import resolve
from cairn._storage.measured import measured_bandwidth

rate = float(sys.argv[1]) if len(sys.argv) > 1 else 40e6
server = start("moto")
link = ShapedLink.parse(f"{rate/1e6:.0f}MB/s,5ms", server.port).start()
try:
    opts = {**server.options(), "endpoint": link.endpoint}
    path = server.url(server.bucket(), "ck")
    state = make_state(48 << 20)
    st = resolve(path, opts).storage
    for c in (False, True, False, True):
        t0 = time.perf_counter()
        s = cairn.save(path, state, compression=c, overwrite=True, storage_options=opts)
        t = time.perf_counter() - t0
        print(f"compression={c}: {s.bytes_written/1e6:.1f} MB in {t:.2f} s ({s.bytes_written/1e6/t:.1f} MB/s whole save, "
              f"write_s {s.write_s:.2f}); measured raw {measured_bandwidth(st)/1e6:.1f} MB/s, "
              f"coded {measured_bandwidth(st, coded=True)/1e6:.1f} MB/s, codec factor {CODEC_METER.factor():.2f}")
    stats = link.stats()
    print("link rate", rate / 1e6, "MB/s; link stats:",
          {k: v for k, v in stats.items() if k != "requests"} if isinstance(stats, dict) else stats)
finally:
    link.stop()
    server.stop()
