"""Experience: prompt groups generated with the rollout weights and scored (rollout.py: media;
text_rollout.py: answers, with answer_backends.py's samplers), and what an algorithm adds to it
(teacher_targets.py: a teacher's velocities at the states the student visited)."""
