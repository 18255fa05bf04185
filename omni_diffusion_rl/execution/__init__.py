"""Execution modes (colocated | separate | hybrid | auto): costs, scheduler decisions, simulator."""
