"""Diagnosis: the ``flight`` recorder keeps each group's recent collectives and dumps them when one
fails or hangs; ``trace_report`` reads the dumps of a whole job and names the rank it waited for.
"""
