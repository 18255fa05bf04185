"""Questions about clips for answering models: clips on disk (clip_files.py), the JSONL format of a
user's questions (question_file.py) and what a question is once asked (questions.py)."""
