"""Benchmark: streaming token geometry at language-model scale.

2,000,000 tokens x 768 dims with 50,257 next-token classes (Zipf-distributed, like real text)
go through :class:`lapheads.geometry.GeometryAccumulator` (ANOVA within/between sequences,
linguistic-collapse class sums, global second moment, within-sequence cosine) in chunks of
synthetic data. Reported: tokens/s of the full accumulation, the time of the bare covariance
update (float64 conversion + ``Q += X^T X`` on the same chunks, the unavoidable core) measured in
the same run, their ratio (target <= 2x), the finalisation time (NC1, tiled CDNV over all class
pairs, NC2, spectrum), the per-sequence spectra cost on a sample, and the peak RSS of the
process (target <= 2 GiB). Data generation is not timed.

    python benchmarks/geometry.py            # full size (minutes on 2 CPU cores)
    python benchmarks/geometry.py --quick    # 200k tokens
    python benchmarks/geometry.py --tokens 500000 --classes 50257
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch

from lapheads.geometry import GeometryAccumulator, SpectraAccumulator


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2_000_000)
    ap.add_argument("--quick", action="store_true", help="200k tokens")
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--classes", type=int, default=50_257)
    ap.add_argument("--chunk", type=int, default=16_384, help="tokens per update call")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--min-count", type=int, default=1)
    ap.add_argument("--spectra-seqs", type=int, default=16, help="sequences for the per-sequence spectra sample")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "0")) or None)
    args = ap.parse_args()
    if args.quick:
        args.tokens = 200_000
    if args.threads:
        torch.set_num_threads(args.threads)
    D, C, chunk = args.dim, args.classes, args.chunk - args.chunk % args.seq_len
    n_chunks = max(1, args.tokens // chunk)
    N = n_chunks * chunk
    rss0 = _rss_mib()
    g = torch.Generator().manual_seed(0)
    zipf = 1.0 / (torch.arange(C, dtype=torch.float64) + 2.7)
    centres = torch.randn(64, D, generator=g)  # a little class structure; shapes cost, not values

    def make(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gi = torch.Generator().manual_seed(1000 + i)
        lab = torch.multinomial(zipf, chunk, replacement=True, generator=gi)
        x = torch.randn(chunk, D, generator=gi) + centres[lab % 64]
        sid = torch.arange(chunk) // args.seq_len
        return x, sid, lab

    acc = GeometryAccumulator(D, min_count=args.min_count, spectra=False)
    acc.tokens._grow(C)  # the vocabulary size is known up front
    Q = torch.zeros(D, D, dtype=torch.float64)
    t_bare = t_full = 0.0
    for i in range(n_chunks):
        x, sid, lab = make(i)
        t0 = time.perf_counter()
        x64 = x.to(torch.float64)
        Q.addmm_(x64.T, x64)
        t1 = time.perf_counter()
        acc.update(x, sid, token_classes=lab)
        t2 = time.perf_counter()
        t_bare += t1 - t0
        t_full += t2 - t1
    rss_acc = _rss_mib()
    t0 = time.perf_counter()
    res = acc.compute()
    t_fin = time.perf_counter() - t0
    nc = res["nc_tokens"]
    # per-sequence spectra on a sample of sequences of the same shape
    sp = SpectraAccumulator(D)
    x = torch.randn(args.spectra_seqs * args.seq_len, D, generator=g)
    sid = torch.arange(x.shape[0]) // args.seq_len
    t0 = time.perf_counter()
    sp.update(x, sid)
    t_sp = time.perf_counter() - t0
    sp_tok_s = x.shape[0] / t_sp
    peak = _peak_mib()
    ratio = t_full / t_bare
    print("## Geometry: streaming accumulators\n")
    print(
        f"{N:,} tokens x {D} dims, {C:,} next-token classes (Zipf), {N // args.seq_len:,} sequences of "
        f"{args.seq_len}, chunks of {chunk:,}, {torch.get_num_threads()} torch threads.\n"
    )
    print("| measure | value |\n|---|---|")
    print(f"| full accumulation (ANOVA + class sums + X^T X + cosine) | {t_full:.1f} s, {N / t_full:,.0f} tokens/s |")
    print(f"| bare covariance update (float64 X^T X, same chunks) | {t_bare:.1f} s, {N / t_bare:,.0f} tokens/s |")
    print(f"| ratio full / bare (target <= 2) | {ratio:.2f} {'OK' if ratio <= 2 else 'MISSED'} |")
    print(
        f"| finalisation (NC1, tiled CDNV over {int(nc['n_classes']):,} classes = {nc['n_pairs']:,.0f} pairs, NC2, spectrum) | {t_fin:.1f} s |"
    )
    print(
        f"| per-sequence spectra (eigvalsh, T={args.seq_len}), sampled on {args.spectra_seqs} sequences | {sp_tok_s:,.0f} tokens/s |"
    )
    print(f"| RSS before / after accumulation | {rss0:,.0f} / {rss_acc:,.0f} MiB |")
    print(f"| peak RSS (target <= 2048 MiB) | {peak:,.0f} MiB {'OK' if peak <= 2048 else 'MISSED'} |")
    print(
        f"\nSanity: NC1 {nc['nc1']:.4g}, CDNV {nc['cdnv']:.4g}, within-sequence fraction "
        f"{res['anova']['frac_within_sequence']:.4f}, cosine {res['cosine']['cosine_mean']:.4f}."
    )


if __name__ == "__main__":
    main()
