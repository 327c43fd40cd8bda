/* shards.common._zframes: whole ZeroMQ messages in one C call, for the hot path.
 *
 * pyzmq's per-frame calls cost ~0.6 us each once the MORE flag is checked from Python
 * (a Frame object per frame, or a getsockopt per frame). Here a message is read frame
 * by frame with zmq_msg_recv and zmq_msg_more, so every message boundary is seen and a
 * short, long or many-frame message can never be merged with the next one.
 *
 * The module does not link against libzmq: bind() is given the path of the libzmq that
 * pyzmq has already loaded in this process, and resolves the few functions it needs
 * from it (dlopen with RTLD_NOLOAD first). So the extension needs no zmq.h and always
 * talks to pyzmq's own libzmq. zmq_msg_t is 64 opaque bytes in every libzmq 4.x.
 *
 * Socket handles are the integers pyzmq gives as Socket.underlying. The caller
 * guarantees that the socket is open: drain() checks its owner's `_closed` after every
 * handler call, because a handler may close its own socket.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <string.h>

typedef struct { unsigned char bytes[64]; } __attribute__((aligned(8))) zmsg_t;

static int (*z_msg_init)(zmsg_t *);
static int (*z_msg_recv)(zmsg_t *, void *, int);
static void *(*z_msg_data)(zmsg_t *);
static size_t (*z_msg_size)(const zmsg_t *);
static int (*z_msg_more)(const zmsg_t *);
static int (*z_msg_close)(zmsg_t *);
static int (*z_send)(void *, const void *, size_t, int);
static int (*z_errno)(void);
static PyObject *error_factory = NULL; /* errno -> zmq.ZMQError (or zmq.Again), from bind() */
static int bound = 0;
static int last_send_errno = 0; /* the errno of send_frames_at's last failure */
static PyObject *closed_name = NULL; /* "_closed", interned */

#define Z_NOBLOCK 1
#define Z_SNDMORE 2

static PyObject *raise_zmq(int err) {
    PyObject *exc = PyObject_CallFunction(error_factory, "i", err);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

static PyObject *zf_bind(PyObject *self, PyObject *args) {
    const char *path;
    PyObject *factory;
    if (!PyArg_ParseTuple(args, "sO", &path, &factory))
        return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL)
        lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        PyErr_Format(PyExc_ImportError, "cannot open %s: %s", path, dlerror());
        return NULL;
    }
#define RESOLVE(var, name)                                                          \
    *(void **)(&var) = dlsym(lib, name);                                            \
    if (var == NULL) {                                                              \
        PyErr_Format(PyExc_ImportError, "%s has no %s", path, name);                \
        return NULL;                                                                \
    }
    RESOLVE(z_msg_init, "zmq_msg_init");
    RESOLVE(z_msg_recv, "zmq_msg_recv");
    RESOLVE(z_msg_data, "zmq_msg_data");
    RESOLVE(z_msg_size, "zmq_msg_size");
    RESOLVE(z_msg_more, "zmq_msg_more");
    RESOLVE(z_msg_close, "zmq_msg_close");
    RESOLVE(z_send, "zmq_send");
    RESOLVE(z_errno, "zmq_errno");
#undef RESOLVE
    Py_XDECREF(error_factory);
    Py_INCREF(factory);
    error_factory = factory;
    bound = 1;
    Py_RETURN_NONE;
}

/* One frame into a new bytes object; NULL with *err set (0 with a Python error). */
static PyObject *recv_frame(void *sock, int flags, int *more, int *err) {
    zmsg_t msg;
    z_msg_init(&msg);
    for (;;) {
        int rc;
        if (flags & Z_NOBLOCK) {
            rc = z_msg_recv(&msg, sock, flags);
        } else {
            Py_BEGIN_ALLOW_THREADS
            rc = z_msg_recv(&msg, sock, flags);
            Py_END_ALLOW_THREADS
        }
        if (rc >= 0)
            break;
        int e = z_errno();
        if (e == EINTR && PyErr_CheckSignals() == 0)
            continue;
        z_msg_close(&msg);
        *err = e == EINTR ? 0 : e; /* EINTR here: a signal handler raised */
        return NULL;
    }
    PyObject *frame = PyBytes_FromStringAndSize((const char *)z_msg_data(&msg),
                                                (Py_ssize_t)z_msg_size(&msg));
    *more = z_msg_more(&msg);
    z_msg_close(&msg);
    if (frame == NULL)
        *err = 0;
    return frame;
}

/* One whole message: a list of at most max_frames + 1 frames (the rest are read and
 * discarded), NULL with *err = EAGAIN when none is waiting. */
static PyObject *recv_message(void *sock, int flags, Py_ssize_t max_frames, int *err) {
    int more = 0;
    PyObject *frame = recv_frame(sock, flags, &more, err);
    if (frame == NULL)
        return NULL;
    PyObject *frames = PyList_New(1);
    if (frames == NULL) {
        Py_DECREF(frame);
        *err = 0;
        return NULL;
    }
    PyList_SET_ITEM(frames, 0, frame);
    while (more) {
        /* the rest of a message is there once its first frame was read (libzmq delivers
         * messages whole); should it ever not be, wait for it rather than misalign */
        frame = recv_frame(sock, flags | Z_NOBLOCK, &more, err);
        if (frame == NULL && *err == EAGAIN)
            frame = recv_frame(sock, flags & ~Z_NOBLOCK, &more, err);
        if (frame == NULL) {
            Py_DECREF(frames);
            return NULL;
        }
        if (PyList_GET_SIZE(frames) <= max_frames) {
            if (PyList_Append(frames, frame) < 0) {
                Py_DECREF(frame);
                Py_DECREF(frames);
                *err = 0;
                return NULL;
            }
        }
        Py_DECREF(frame);
    }
    return frames;
}

static int check_bound(void) {
    if (!bound) {
        PyErr_SetString(PyExc_RuntimeError, "_zframes.bind() was not called");
        return 0;
    }
    return 1;
}

/* recv(handle, flags, max_frames) -> list[bytes] | None (None: nothing waiting) */
static PyObject *zf_recv(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "recv(handle, flags, max_frames)");
        return NULL;
    }
    if (!check_bound())
        return NULL;
    void *sock = PyLong_AsVoidPtr(args[0]);
    int flags = (int)PyLong_AsLong(args[1]);
    Py_ssize_t max_frames = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred())
        return NULL;
    int err = 0;
    PyObject *frames = recv_message(sock, flags, max_frames, &err);
    if (frames != NULL)
        return frames;
    if (err == EAGAIN)
        Py_RETURN_NONE;
    return err ? raise_zmq(err) : NULL;
}

/* drain(handle, owner, limit, max_frames, handler) -> (n, exc, frames)
 * Read up to `limit` messages and call handler(frames) for each. Stops at EAGAIN, when
 * `owner._closed` turns true (the owner closed the socket), or when the handler raises:
 * then exc is the exception and frames the message it failed on (n counts it). */
static PyObject *zf_drain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "drain(handle, owner, limit, max_frames, handler)");
        return NULL;
    }
    if (!check_bound())
        return NULL;
    void *handle = PyLong_AsVoidPtr(args[0]);
    PyObject *owner = args[1];
    Py_ssize_t limit = PyLong_AsSsize_t(args[2]);
    Py_ssize_t max_frames = PyLong_AsSsize_t(args[3]);
    PyObject *handler = args[4];
    if (PyErr_Occurred())
        return NULL;
    Py_ssize_t n = 0;
    while (n < limit) {
        int err = 0;
        PyObject *frames = recv_message(handle, Z_NOBLOCK, max_frames, &err);
        if (frames == NULL) {
            if (err == EAGAIN)
                break;
            return err ? raise_zmq(err) : NULL;
        }
        n++;
        PyObject *res = PyObject_CallOneArg(handler, frames);
        if (res == NULL) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            if (tb != NULL && value != NULL)
                PyException_SetTraceback(value, tb);
            Py_XDECREF(type);
            Py_XDECREF(tb);
            PyObject *out = Py_BuildValue("(nNN)", n, value ? value : Py_NewRef(Py_None),
                                          frames);
            return out;
        }
        Py_DECREF(res);
        Py_DECREF(frames);
        PyObject *closed = PyObject_GetAttr(owner, closed_name);
        if (closed == NULL)
            return NULL;
        int is_closed = PyObject_IsTrue(closed);
        Py_DECREF(closed);
        if (is_closed)
            break;
    }
    return Py_BuildValue("(nOO)", n, Py_None, Py_None);
}

/* Send `count` frames from `items` as one message: every frame is checked to be bytes
 * before the first goes out (all or nothing: never half a message). The frames are held
 * (a reference each, their pointers copied) while sending, because a blocking send lets
 * other threads run and a signal handler may run on EINTR: either could change the
 * sequence the pointers came from. */
static int send_frames_at(void *sock, PyObject *const *items, Py_ssize_t count, int flags) {
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!PyBytes_Check(items[i])) {
            PyErr_Format(PyExc_TypeError, "frame %zd is %.100s, not bytes", i,
                         Py_TYPE(items[i])->tp_name);
            return -1;
        }
    }
    PyObject *stack[16];
    PyObject **held = stack;
    if (count > 16) {
        held = PyMem_Malloc((size_t)count * sizeof(PyObject *));
        if (held == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        held[i] = items[i];
        Py_INCREF(held[i]);
    }
    int result = 0;
    for (Py_ssize_t i = 0; i < count && result == 0; i++) {
        char *data = PyBytes_AS_STRING(held[i]);
        Py_ssize_t size = PyBytes_GET_SIZE(held[i]);
        int f = i + 1 < count ? (flags | Z_SNDMORE) : flags;
        for (;;) {
            int rc;
            if (flags & Z_NOBLOCK) {
                rc = z_send(sock, data, (size_t)size, f);
            } else {
                Py_BEGIN_ALLOW_THREADS
                rc = z_send(sock, data, (size_t)size, f);
                Py_END_ALLOW_THREADS
            }
            if (rc >= 0)
                break;
            int e = z_errno();
            if (e == EINTR && PyErr_CheckSignals() == 0)
                continue;
            last_send_errno = e;
            if (e != EINTR)
                raise_zmq(e);
            result = -1;
            break;
        }
    }
    for (Py_ssize_t i = 0; i < count; i++)
        Py_DECREF(held[i]);
    if (held != stack)
        PyMem_Free(held);
    return result;
}

/* One message from a sequence of bytes frames; 0, or -1 with a Python error set. */
static int send_message(void *sock, PyObject *frames, int flags) {
    PyObject *seq = PySequence_Fast(frames, "a message must be a sequence of frames");
    if (seq == NULL)
        return -1;
    int rc = send_frames_at(sock, PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq),
                            flags);
    Py_DECREF(seq);
    return rc;
}

/* send(handle, frames, flags=NOBLOCK): a multipart message from a sequence of bytes;
 * a blocking send lets other threads run meanwhile */
static PyObject *zf_send(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "send(handle, frames, flags=NOBLOCK)");
        return NULL;
    }
    if (!check_bound())
        return NULL;
    void *sock = PyLong_AsVoidPtr(args[0]);
    int flags = nargs == 3 ? (int)PyLong_AsLong(args[2]) : Z_NOBLOCK;
    if (PyErr_Occurred())
        return NULL;
    if (send_message(sock, args[1], flags) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* A signal handler run on EINTR may have changed the sequence being sent: re-read its
 * items, and refuse to go on if its length changed. */
static int still_whole(PyObject *seq, Py_ssize_t count, PyObject ***items) {
    if (PySequence_Fast_GET_SIZE(seq) != count) {
        PyErr_SetString(PyExc_RuntimeError, "the messages changed while being sent");
        return 0;
    }
    *items = PySequence_Fast_ITEMS(seq);
    return 1;
}

/* send_many(handle, messages, width=0) -> sent: each message non-blocking, in order;
 * stops at the first that fails (EAGAIN at a high-water mark: the rest are not sent) and
 * raises. With width > 0, `messages` is one flat sequence of frames, `width` frames to a
 * message (a ring of recent updates kept that way holds no object per update for the
 * cyclic garbage collector to walk); a trailing partial message is refused unsent. */
static PyObject *zf_send_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "send_many(handle, messages, width=0)");
        return NULL;
    }
    if (!check_bound())
        return NULL;
    void *sock = PyLong_AsVoidPtr(args[0]);
    Py_ssize_t width = nargs == 3 ? PyLong_AsSsize_t(args[2]) : 0;
    if (PyErr_Occurred())
        return NULL;
    if (width < 0) {
        PyErr_SetString(PyExc_ValueError, "width must be >= 0");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[1], "messages must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (width == 0) {
        for (Py_ssize_t i = 0; i < count; i++) {
            if (!still_whole(seq, count, &items)) {
                Py_DECREF(seq);
                return NULL;
            }
            if (send_message(sock, items[i], Z_NOBLOCK) < 0) {
                Py_DECREF(seq);
                return NULL;
            }
        }
        Py_DECREF(seq);
        return PyLong_FromSsize_t(count);
    }
    if (count % width) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "%zd frames are not whole messages of %zd", count,
                     width);
        return NULL;
    }
    Py_ssize_t sent = 0;
    for (Py_ssize_t i = 0; i < count; i += width) {
        if (!still_whole(seq, count, &items)) {
            Py_DECREF(seq);
            return NULL;
        }
        if (send_frames_at(sock, items + i, width, Z_NOBLOCK) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        sent++;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(sent);
}

/* send_rows(handle, identity, rows, start, stop) -> next: a ROUTER's snapshot rows, each
 * (key, value, seq, props) sent as [identity, key, seq, "", props, value], non-blocking,
 * from rows[start] to rows[stop - 1]. Returns the index of the first row not sent: stop,
 * or earlier where the peer's pipe is at its high-water mark (EAGAIN comes only at a
 * message's first frame: no row is ever half sent). Any other error raises (the rows
 * before it were sent). One C call per chunk instead of six Python calls per row. */
static PyObject *zf_send_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "send_rows(handle, identity, rows, start, stop)");
        return NULL;
    }
    if (!check_bound())
        return NULL;
    void *sock = PyLong_AsVoidPtr(args[0]);
    Py_ssize_t start = PyLong_AsSsize_t(args[3]);
    Py_ssize_t stop = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred())
        return NULL;
    if (!PyBytes_Check(args[1]) || !PyList_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "send_rows: identity must be bytes, rows a list");
        return NULL;
    }
    PyObject *identity = args[1], *rows = args[2];
    Py_INCREF(identity);
    Py_INCREF(rows);
    PyObject *empty = PyBytes_FromStringAndSize(NULL, 0);
    Py_ssize_t i = start < 0 ? 0 : start;
    PyObject *result = NULL;
    if (empty == NULL)
        goto done;
    for (; i < stop && i < PyList_GET_SIZE(rows); i++) {
        PyObject *row = PyList_GET_ITEM(rows, i);
        if (!PyTuple_CheckExact(row) || PyTuple_GET_SIZE(row) != 4) {
            PyErr_Format(PyExc_TypeError, "row %zd is not a (key, value, seq, props) tuple", i);
            goto done;
        }
        PyObject *frames[6] = {identity, PyTuple_GET_ITEM(row, 0), PyTuple_GET_ITEM(row, 2),
                               empty, PyTuple_GET_ITEM(row, 3), PyTuple_GET_ITEM(row, 1)};
        last_send_errno = 0;
        if (send_frames_at(sock, frames, 6, Z_NOBLOCK) < 0) {
            if (last_send_errno == EAGAIN) {
                PyErr_Clear();
                break;
            }
            goto done;
        }
    }
    result = PyLong_FromSsize_t(i);
done:
    Py_XDECREF(empty);
    Py_DECREF(rows);
    Py_DECREF(identity);
    return result;
}

/* untrack(frames) -> frames: take a list that holds only bytes (and will only ever hold
 * bytes) off the cyclic garbage collector's lists. Bytes reference nothing, so such a list
 * can never be part of a reference cycle; its reference count still frees it. CPython
 * does the same for tuples and dicts of atomic contents, never for lists, which could
 * later take a container. The resume history keeps ~100,000 updates' frames in lists
 * like this: tracked, every older-generation collection walked all of them (4-7 ms). */
static PyObject *zf_untrack(PyObject *self, PyObject *frames) {
    if (!PyList_CheckExact(frames)) {
        PyErr_Format(PyExc_TypeError, "untrack takes a list, not %.100s",
                     Py_TYPE(frames)->tp_name);
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(frames);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!PyBytes_CheckExact(PyList_GET_ITEM(frames, i))) {
            PyErr_Format(PyExc_TypeError, "item %zd is %.100s, not bytes", i,
                         Py_TYPE(PyList_GET_ITEM(frames, i))->tp_name);
            return NULL;
        }
    }
    PyObject_GC_UnTrack(frames);
    Py_INCREF(frames);
    return frames;
}

static PyMethodDef methods[] = {
    {"untrack", zf_untrack, METH_O,
     "untrack(frames) -> frames: a list of bytes off the cyclic GC's lists"},
    {"send_many", (PyCFunction)(void (*)(void))zf_send_many, METH_FASTCALL,
     "send_many(handle, messages, width=0) -> sent"},
    {"send_rows", (PyCFunction)(void (*)(void))zf_send_rows, METH_FASTCALL,
     "send_rows(handle, identity, rows, start, stop) -> next"},
    {"bind", zf_bind, METH_VARARGS,
     "bind(libzmq_path, error_of_errno): resolve libzmq's calls"},
    {"recv", (PyCFunction)(void (*)(void))zf_recv, METH_FASTCALL,
     "recv(handle, flags, max_frames) -> list[bytes] | None"},
    {"drain", (PyCFunction)(void (*)(void))zf_drain, METH_FASTCALL,
     "drain(handle, owner, limit, max_frames, handler) -> (n, exc, frames)"},
    {"send", (PyCFunction)(void (*)(void))zf_send, METH_FASTCALL,
     "send(handle, frames, flags=NOBLOCK)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_zframes", NULL, -1, methods};

PyMODINIT_FUNC PyInit__zframes(void) {
    closed_name = PyUnicode_InternFromString("_closed");
    if (closed_name == NULL)
        return NULL;
    return PyModule_Create(&module);
}
