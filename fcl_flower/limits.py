"""Bounds shared by the protocol's readers (NumPy only) and the analytic checks (torch): no imports."""

#: entries beyond this could overflow float64 in sums of squares (1e300 < 1.8e308)
MAGNITUDE_LIMIT = 1e150
