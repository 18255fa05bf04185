"""Experience: prompt groups generated with the rollout weights and scored (rollout.py: media;
text_rollout.py: answers, with answer_backends.py's samplers), what an algorithm adds to it
(teacher_targets.py: a teacher's velocities at the states the student visited), and the samplers
themselves (sampling.py: time grids and ODE solvers; text_sampling.py: answers token by token),
which sit in the lowest layer so that models may use them."""
