import traceback

import torch

from oscarkv.kernels import ref
from oscarkv.kernels.triton import decode_attention as td
from oscarkv.quant import RowFormat

fmt = RowFormat(128, 2, 128)
kc = torch.randint(0, 256, (300, 8, 32), dtype=torch.uint8, device="cuda")
km = torch.rand(300, 8, 1, 2, device="cuda").half()
hk = torch.randn(40, 8, 128, device="cuda", dtype=torch.bfloat16)
qi = torch.tensor([0, 300], dtype=torch.int32, device="cuda")
qx = torch.arange(300, dtype=torch.int32, device="cuda")
hi = torch.tensor([0, 40], dtype=torch.int32, device="cuda")
hx = torch.arange(40, dtype=torch.int32, device="cuda")
q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
try:
    o = td.decode_attention(q, kc, km, kc, km, hk, hk, qi, qx, hi, hx, 0.088, fmt, fmt)
    r = ref.decode_attention(
        q.float(), kc, km, kc, km, hk.float(), hk.float(), qi, qx, hi, hx, 0.088, fmt, fmt
    )
    print("COMPILE OK rel err", ((o.float() - r).norm() / r.norm()).item())
except Exception:
    traceback.print_exc()
