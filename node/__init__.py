"""prefixmesh.node"""
