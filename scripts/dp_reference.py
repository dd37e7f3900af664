"""Reference numbers for federated/tests/dp.rs, from Google's dp-accounting (PyPI `dp-accounting`).

Run in a throwaway venv: python3 -m venv /tmp/v && /tmp/v/bin/pip install dp-accounting &&
/tmp/v/bin/python scripts/dp_reference.py. Not used by CI.
"""
import importlib.metadata as md

from dp_accounting.rdp import rdp_privacy_accountant as rdp
from dp_accounting import dp_event

print("dp-accounting", md.version("dp-accounting"))
for q, z, orders in [(0.01, 1.1, [1.5, 2, 2.5, 10.5, 32, 256]), (0.1, 0.8, [1.5, 3, 7.3, 64]), (0.001, 4.0, [2, 1.2, 1024])]:
    vals = rdp._compute_rdp_poisson_subsampled_gaussian(q, z, orders)
    for a, v in zip(orders, vals):
        print(f"rdp q={q} z={z} order={a}: {v!r}")
for q, z, steps, delta in [(0.01, 1.1, 100, 1e-5), (0.1, 1.0, 50, 1e-6), (0.001, 0.7, 1000, 1e-5), (0.01, 5.0, 1, 1e-5)]:
    acc = rdp.RdpAccountant()
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), steps)
    eps, order = acc.get_epsilon_and_optimal_order(delta)
    print(f"eps q={q} z={z} steps={steps} delta={delta}: {eps!r} order {order}")
