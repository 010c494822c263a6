"""specdec.verify"""
