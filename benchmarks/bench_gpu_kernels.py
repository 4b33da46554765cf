"""ddl's GPU reduction kernels against a device-to-device copy: GB/s and ratio (target >= 85%).

    python benchmarks/bench_gpu_kernels.py [--sizes 1MiB,16MiB,256MiB] [--dtypes float32,float16,bfloat16]
                                           [--inputs 1,2,4] [--op sum] [--iters 50] [--misaligned]

Bandwidth is device-memory traffic: a reduction of k incoming chunks reads k + 1 operands and writes
one, (k + 2) x size bytes; a copy reads and writes, 2 x size bytes. The ratio compares the two rates,
so 100% means the kernel streams memory as fast as cudaMemcpy does. ``--misaligned`` offsets every
operand by one element (vector head/tail still co-aligned) to show the cost of the scalar edges.
Needs CuPy and a CUDA device; without, it says so on stderr and exits with status 1 (it measured
nothing). A bad argument is one line and exit status 2, with or without a device.
"""
import argparse
import sys

from ddl.cli.argtypes import gpu_dtype, list_of, reported
from ddl.errors import Error
from ddl.units import parse_size

TARGET = 0.85


def _count(text):
    value = int(text)
    if value < 1:
        raise ValueError(f"at least 1, got {value}")
    return value


def main(argv=None):
    from ddl.gpu import kernels as K

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=list_of(parse_size), default="1MiB,16MiB,256MiB")
    ap.add_argument("--dtypes", type=list_of(gpu_dtype), default="float32,float16,bfloat16,float64,int32")
    ap.add_argument("--inputs", type=list_of(_count), default="1,2,4")
    ap.add_argument("--op", type=str.upper, choices=K.OPS, default="SUM")
    ap.add_argument("--iters", type=reported(_count), default=50)
    ap.add_argument("--misaligned", action="store_true")
    args = ap.parse_args(argv)
    for dt in args.dtypes:          # an op the dtype lacks (BAND on float32) is refused before any device work
        try:
            K.kernel_source(args.op, dt, 1)
        except Error as exc:
            ap.error(f"argument --op: {exc}")

    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
    except Exception as exc:
        print(f"{ap.prog}: no CUDA device ({type(exc).__name__}: {exc}): nothing to benchmark; "
              f"it needs CuPy and a GPU", file=sys.stderr)
        return 1

    from ddl.units import format_size

    cache = K.KernelCache()
    stream = cupy.cuda.get_current_stream()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()

    def timed(fn):
        fn()
        start.record()
        for _ in range(args.iters):
            fn()
        stop.record()
        stop.synchronize()
        return cupy.cuda.get_elapsed_time(start, stop) / 1e3 / args.iters

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    print(f"device: {props['name'].decode() if isinstance(props['name'], bytes) else props['name']}, "
          f"{props['multiProcessorCount']} SMs; op {args.op.upper()}; {args.iters} iterations")
    print(f"{'dtype':>9} {'size':>9} {'inputs':>6} {'kernel GB/s':>12} {'copy GB/s':>10} {'ratio':>6}")
    worst = None
    for nbytes in args.sizes:
        for dt in args.dtypes:
            off = dt.itemsize if args.misaligned else 0
            n = nbytes // dt.itemsize
            for k in args.inputs:
                bufs = [cupy.empty(nbytes + 64, cupy.uint8) for _ in range(k + 1)]
                for b in bufs:
                    b.fill(0)
                ptrs = [b.data.ptr + off for b in bufs]
                dst = cupy.empty(nbytes + 64, cupy.uint8)
                t_copy = timed(lambda: cupy.cuda.runtime.memcpyAsync(dst.data.ptr + off, ptrs[0], nbytes, 3, stream.ptr))
                t_red = timed(lambda: cache.reduce(args.op, dt, ptrs[0], ptrs[0], ptrs[1:], n))
                copy_bw = 2 * nbytes / t_copy / 1e9
                red_bw = (k + 2) * nbytes / t_red / 1e9
                ratio = red_bw / copy_bw
                if nbytes >= 64 << 20:
                    worst = ratio if worst is None else min(worst, ratio)
                print(f"{dt.name:>9} {format_size(nbytes):>9} {k:>6} {red_bw:>12.0f} {copy_bw:>10.0f} {ratio:>6.2f}")
    if worst is not None:
        verdict = "meets" if worst >= TARGET else "MISSES"
        print(f"worst ratio at >= 64 MiB: {worst:.2f} ({verdict} the {TARGET:.0%} target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
