"""specdec.draft"""
