"""prefixmesh.bench"""
