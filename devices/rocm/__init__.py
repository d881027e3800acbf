"""rocm"""
