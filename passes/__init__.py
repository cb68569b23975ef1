"""The compiler passes of mobius_fx, one per module (installed as `mobius_fx.passes`).

trace -> annotate -> partition -> cross_map -> insert_transfers -> emit
"""
