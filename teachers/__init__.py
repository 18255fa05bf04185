"""Built-in teachers for on-policy distillation (registered in pyproject.toml's entry-point group
`omni_diffusion_rl.teachers`): `policy` serves any model family's policy, the shipped tiny teacher
by default. See omni_diffusion_rl/teacher.py for the contract."""
