"""The compiler passes of mobius_fx, one per module (installed as `mobius_fx.passes`).

trace -> annotate -> partition (cut + cross_map) -> plan -> insert_transfers -> emit
"""
