"""prefixmesh.inference"""
