"""prefixmesh.overlay"""
