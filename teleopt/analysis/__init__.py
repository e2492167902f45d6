"""Analysis tools built on parameter-space symmetries.

Conserved quantities of gradient flow (papers/001 Sec. 2.5, papers/002 Sec. 5),
orbits and group-action ensembles (papers/002 Sec. 6), and learned invariance of
linear models under data symmetries (papers/004).
"""
