import sys, torch, triton
sys.path.insert(0, ".")
from triton.testing import do_bench
from cat_fast.triton import cmix, cal_objective, cal_step, crm_loss, gs_cosine_loss
print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
dev = "cuda"
B, T, D = 64, 512, 1024
for dt in (torch.bfloat16, torch.float32):
    h = torch.randn(B, T, D, device=dev, dtype=dt); g = torch.randn_like(h)
    partner = torch.randperm(B, device=dev)
    N = h.numel() * h.element_size()
    tc = do_bench(lambda: h.clone())
    print(f"{dt}: clone {tc*1e3:.1f}us -> {2*N/tc/1e6:.0f} GB/s")
    for per_tok in (False, True):
        lam = torch.rand((B, T) if per_tok else (B,), device=dev)
        tf = do_bench(lambda: cmix.cmix_forward(h, lam, partner))
        tb = do_bench(lambda: cmix.cmix_backward(g, h, lam, partner))
        # reference torch eager
        lt = lam[:, :, None] if per_tok else lam[:, None, None]
        tr = do_bench(lambda: (lt * h[partner].float() + (1 - lt) * h.float()).to(dt))
        print(f"  per_tok={per_tok}: fwd {tf*1e3:.1f}us ({3*N/tf/1e6:.0f} GB/s @3N, {tc/tf*1.5:.2f}x copy-rate) "
              f"bwd {tb*1e3:.1f}us ({5*N/tb/1e6:.0f} GB/s @5N) | torch eager fwd {tr*1e3:.1f}us")
    # repeats partner
    lam = torch.rand(B, device=dev)
    p2 = torch.zeros(B, dtype=torch.int64, device=dev)
    tb = do_bench(lambda: cmix.cmix_backward(g, h, lam, p2))
    print(f"  bwd all-partner-0: {tb*1e3:.1f}us")
for (Bc, C) in [(256, 10), (4096, 1000), (512, 32000)]:
    z = torch.randn(Bc, C, device=dev, dtype=torch.bfloat16); zc = torch.randn_like(z)
    y = torch.randint(0, C, (Bc,), device=dev)
    gg = torch.randn(Bc, device=dev)
    t1 = do_bench(lambda: cal_objective.cal_objective_forward(z, y, 0.5, 0.5))
    t2 = do_bench(lambda: cal_objective.cal_objective_backward(gg, z, y, 0.5, 0.5))
    t3 = do_bench(lambda: crm_loss.crm_loss_forward(z, zc, y, 0.5, 2.0, 1, False))
    t3n = do_bench(lambda: crm_loss.crm_loss_forward(z, zc, y, 0.5, 2.0, 0, False))
    l, st = crm_loss.crm_loss_forward(z, zc, y, 0.5, 2.0, 1, False)
    t4 = do_bench(lambda: crm_loss.crm_loss_backward(l, z, zc, y, st, 0.5, 2.0, 1, False))
    print(f"[{Bc},{C}] bf16: calobj fwd {t1*1e3:.1f}us bwd {t2*1e3:.1f}us | crm fwd mean {t3*1e3:.1f}us none {t3n*1e3:.1f}us bwd {t4*1e3:.1f}us")
lam = torch.rand(64, 512, device=dev); gl = torch.randn_like(lam)
print("cal_step_ [64,512] p=2:", f"{do_bench(lambda: cal_step.cal_step_(lam, gl, 0.0, 2.0, -1e9, 1e9))*1e3:.1f}us ")
x = torch.randn(32768, 1024, device=dev, dtype=torch.bfloat16); y2 = torch.randn_like(x)
coef = torch.randn(32768, 4, device=dev)
print("gs_row_dots [32768,1024] bf16:", f"{do_bench(lambda: gs_cosine_loss.gs_row_dots(x, y2))*1e3:.1f}us",
      "gs_row_combine:", f"{do_bench(lambda: gs_cosine_loss.gs_row_combine(x, y2, coef))*1e3:.1f}us",
      "clone x:", f"{do_bench(lambda: x.clone())*1e3:.1f}us")
