"""The on-storage format, shared by saving and loading: the manifest (``manifest``, bounded by
``limits``), the state tree's skeleton (``tree``, decoded by ``skeleton``), pickled values (``objects``) and composite
indexes (``composite``).
"""
