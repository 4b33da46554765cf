"""Host memory presented as a device array (``__cuda_array_interface__``), for MPI test scripts that
drive ddl's device code paths without a GPU."""


class HostArray:
    def __init__(self, a):
        self.a = a

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.a.shape, "typestr": self.a.dtype.str, "data": (self.a.ctypes.data, False),
                "strides": None, "version": 3}

    @property
    def dtype(self):
        return self.a.dtype
