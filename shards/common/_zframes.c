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
 * It also carries the send guard (guard_send, below): libzmq's own calls to send() go
 * through a wrapper that keeps an EACCES from aborting the process.
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
#ifdef __linux__
#include <elf.h>
#include <link.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>
#endif

typedef struct { unsigned char bytes[64]; } __attribute__((aligned(8))) zmsg_t;

static int (*z_msg_init)(zmsg_t *);
static int (*z_msg_recv)(zmsg_t *, void *, int);
static void *(*z_msg_data)(zmsg_t *);
static size_t (*z_msg_size)(const zmsg_t *);
static int (*z_msg_more)(const zmsg_t *);
static int (*z_msg_close)(zmsg_t *);
static const char *(*z_msg_gets)(const zmsg_t *, const char *);
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
    RESOLVE(z_msg_gets, "zmq_msg_gets");
    RESOLVE(z_send, "zmq_send");
    RESOLVE(z_errno, "zmq_errno");
#undef RESOLVE
    Py_XDECREF(error_factory);
    Py_INCREF(factory);
    error_factory = factory;
    bound = 1;
    Py_RETURN_NONE;
}

/* One frame into `msg` (initialised by the caller): 0, or -1 with *err set (0 when a
 * signal handler raised on EINTR: a Python error is set). */
static int recv_raw(void *sock, int flags, zmsg_t *msg, int *err) {
    for (;;) {
        int rc;
        if (flags & Z_NOBLOCK) {
            rc = z_msg_recv(msg, sock, flags);
        } else {
            Py_BEGIN_ALLOW_THREADS
            rc = z_msg_recv(msg, sock, flags);
            Py_END_ALLOW_THREADS
        }
        if (rc >= 0)
            return 0;
        int e = z_errno();
        if (e == EINTR && PyErr_CheckSignals() == 0)
            continue;
        *err = e == EINTR ? 0 : e;
        return -1;
    }
}

/* The last User-Id seen, and its str: a connection sends many messages, and a str per
 * message would cost more than the lookup. */
static char user_cache[256];
static PyObject *user_cache_obj = NULL;

/* The message's User-Id (what the ZAP handler named its connection) as a new reference
 * to a str, or to None when it has none; NULL with a Python error. */
static PyObject *user_of(const zmsg_t *msg) {
    const char *uid = z_msg_gets(msg, "User-Id");
    if (uid == NULL)
        Py_RETURN_NONE;
    if (user_cache_obj != NULL && strcmp(uid, user_cache) == 0)
        return Py_NewRef(user_cache_obj);
    PyObject *obj = PyUnicode_DecodeUTF8(uid, (Py_ssize_t)strlen(uid), "replace");
    if (obj == NULL)
        return NULL;
    if (strlen(uid) < sizeof(user_cache)) {
        strcpy(user_cache, uid);
        Py_XSETREF(user_cache_obj, Py_NewRef(obj));
    }
    return obj;
}

/* One frame into a new bytes object; NULL with *err set (0 with a Python error). With
 * `user` not NULL, *user is set to the frame's User-Id (user_of). */
static PyObject *recv_frame_as(void *sock, int flags, int *more, int *err, PyObject **user) {
    zmsg_t msg;
    z_msg_init(&msg);
    if (recv_raw(sock, flags, &msg, err) < 0) {
        z_msg_close(&msg);
        return NULL;
    }
    PyObject *frame = PyBytes_FromStringAndSize((const char *)z_msg_data(&msg),
                                                (Py_ssize_t)z_msg_size(&msg));
    *more = z_msg_more(&msg);
    if (frame != NULL && user != NULL) {
        *user = user_of(&msg);
        if (*user == NULL)
            Py_CLEAR(frame);
    }
    z_msg_close(&msg);
    if (frame == NULL)
        *err = 0;
    return frame;
}

static PyObject *recv_frame(void *sock, int flags, int *more, int *err) {
    return recv_frame_as(sock, flags, more, err, NULL);
}

/* One whole message: a list of at most max_frames + 1 frames (the rest are read and
 * discarded), NULL with *err = EAGAIN when none is waiting. With `user` not NULL, *user
 * is its User-Id (a new reference) when it returns a message. */
static PyObject *recv_message_as(void *sock, int flags, Py_ssize_t max_frames, int *err,
                                 PyObject **user) {
    int more = 0;
    PyObject *frame = recv_frame_as(sock, flags, &more, err, user);
    if (frame == NULL)
        return NULL;
    PyObject *frames = PyList_New(1);
    if (frames == NULL) {
        Py_DECREF(frame);
        if (user != NULL)
            Py_CLEAR(*user);
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
            if (user != NULL)
                Py_CLEAR(*user);
            return NULL;
        }
        if (PyList_GET_SIZE(frames) <= max_frames) {
            if (PyList_Append(frames, frame) < 0) {
                Py_DECREF(frame);
                Py_DECREF(frames);
                if (user != NULL)
                    Py_CLEAR(*user);
                *err = 0;
                return NULL;
            }
        }
        Py_DECREF(frame);
    }
    return frames;
}

static PyObject *recv_message(void *sock, int flags, Py_ssize_t max_frames, int *err) {
    return recv_message_as(sock, flags, max_frames, err, NULL);
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
 * then exc is the exception and frames the message it failed on (n counts it).
 * drain_users: the same, calling handler(frames, user_id) with each message's User-Id
 * (a str, or None without one). */
static PyObject *drain_as(PyObject *const *args, Py_ssize_t nargs, int with_user) {
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
        PyObject *user = NULL;
        PyObject *frames = recv_message_as(handle, Z_NOBLOCK, max_frames, &err,
                                           with_user ? &user : NULL);
        if (frames == NULL) {
            if (err == EAGAIN)
                break;
            return err ? raise_zmq(err) : NULL;
        }
        n++;
        PyObject *res;
        if (with_user) {
            PyObject *call[2] = {frames, user};
            res = PyObject_Vectorcall(handler, call, 2, NULL);
            Py_DECREF(user);
        } else {
            res = PyObject_CallOneArg(handler, frames);
        }
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

static PyObject *zf_drain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return drain_as(args, nargs, 0);
}

static PyObject *zf_drain_users(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return drain_as(args, nargs, 1);
}

/* A snapshot row our servers send (12/CHP KVSYNC: key, 8-byte sequence, empty UUID,
 * empty properties, value) whose key is ASCII, in the subtree, within the limits and not
 * a command word: one the receiver may take without its decoder. */
static int plain_row(zmsg_t *m, const char *sub, Py_ssize_t sublen, Py_ssize_t max_key,
                     Py_ssize_t max_value, PyObject *reserved) {
    size_t ks = z_msg_size(&m[0]);
    if (z_msg_size(&m[1]) != 8 || z_msg_size(&m[2]) != 0 || z_msg_size(&m[3]) != 0)
        return 0;
    if (ks == 0 || ks > (size_t)max_key || ks < (size_t)sublen
        || z_msg_size(&m[4]) > (size_t)max_value)
        return 0;
    const unsigned char *key = z_msg_data(&m[0]);
    if (sublen && memcmp(key, sub, (size_t)sublen) != 0)
        return 0;
    for (size_t i = 0; i < ks; i++)
        if (key[i] & 0x80)
            return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(reserved); i++) {
        PyObject *word = PyTuple_GET_ITEM(reserved, i);
        if ((size_t)PyBytes_GET_SIZE(word) == ks && memcmp(PyBytes_AS_STRING(word), key, ks) == 0)
            return 0;
    }
    return 1;
}

/* Put a plain row into values[key] (unless its value is empty and keep_empty is 0) and
 * seqs[key]; 0, or -1 with a Python error set. */
static int install_row(zmsg_t *m, PyObject *values, PyObject *seqs, int keep_empty) {
    size_t vs = z_msg_size(&m[4]);
    if (vs == 0 && !keep_empty)
        return 0;
    const unsigned char *s = z_msg_data(&m[1]);
    unsigned long long seq = 0;
    for (int i = 0; i < 8; i++)
        seq = (seq << 8) | s[i];
    PyObject *key = PyBytes_FromStringAndSize(z_msg_data(&m[0]), (Py_ssize_t)z_msg_size(&m[0]));
    PyObject *value = PyBytes_FromStringAndSize(z_msg_data(&m[4]), (Py_ssize_t)vs);
    PyObject *number = PyLong_FromUnsignedLongLong(seq);
    int rc = -1;
    if (key != NULL && value != NULL && number != NULL && PyDict_SetItem(values, key, value) == 0
        && PyDict_SetItem(seqs, key, number) == 0)
        rc = 0;
    Py_XDECREF(key);
    Py_XDECREF(value);
    Py_XDECREF(number);
    return rc;
}

/* The frames already read (closed here) and the rest of the message, as recv_message
 * gives them: a list of at most max_frames + 1 frames. NULL with *err set. */
static PyObject *rest_of_message(void *sock, zmsg_t *m, int k, int more, Py_ssize_t max_frames,
                                 int *err) {
    PyObject *frames = PyList_New(0);
    for (int i = 0; i < k; i++) {
        if (frames != NULL) {
            PyObject *frame = PyBytes_FromStringAndSize(z_msg_data(&m[i]),
                                                        (Py_ssize_t)z_msg_size(&m[i]));
            if (frame == NULL || (PyList_GET_SIZE(frames) <= max_frames
                                  && PyList_Append(frames, frame) < 0))
                Py_CLEAR(frames);
            Py_XDECREF(frame);
        }
        z_msg_close(&m[i]);
    }
    while (more) { /* read to the end even when out of memory: never misalign */
        PyObject *frame = recv_frame(sock, Z_NOBLOCK, &more, err);
        if (frame == NULL && *err == EAGAIN)
            frame = recv_frame(sock, 0, &more, err);
        if (frame == NULL) {
            Py_XDECREF(frames);
            return NULL;
        }
        if (frames != NULL && PyList_GET_SIZE(frames) <= max_frames
            && PyList_Append(frames, frame) < 0)
            Py_CLEAR(frames);
        Py_DECREF(frame);
    }
    if (frames == NULL)
        *err = 0;
    return frames;
}

/* take_rows(handle, limit, max_frames, values, seqs, subtree, max_key, max_value,
 *           reserved, keep_empty) -> (n, frames)
 * A snapshot's plain rows (see plain_row) straight into the receiver's dicts, without a
 * bytes object for the empty frames, a list per message or a Python call per row: up to
 * `limit` messages. Stops at EAGAIN or the limit (frames None), or at the first message
 * that is not a plain row, which it returns whole (as recv would) for the receiver's own
 * decoder; n counts the plain rows taken (a row with an empty value counts, and is put
 * only when keep_empty). */
static PyObject *zf_take_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "take_rows(handle, limit, max_frames, values, seqs, "
                        "subtree, max_key, max_value, reserved, keep_empty)");
        return NULL;
    }
    if (!check_bound())
        return NULL;
    void *sock = PyLong_AsVoidPtr(args[0]);
    Py_ssize_t limit = PyLong_AsSsize_t(args[1]);
    Py_ssize_t max_frames = PyLong_AsSsize_t(args[2]);
    Py_ssize_t max_key = PyLong_AsSsize_t(args[6]);
    Py_ssize_t max_value = PyLong_AsSsize_t(args[7]);
    int keep_empty = PyObject_IsTrue(args[9]);
    if (PyErr_Occurred() || keep_empty < 0)
        return NULL;
    PyObject *values = args[3], *seqs = args[4], *subtree = args[5], *reserved = args[8];
    if (!PyDict_CheckExact(values) || !PyDict_CheckExact(seqs) || !PyBytes_Check(subtree)
        || !PyTuple_CheckExact(reserved)) {
        PyErr_SetString(PyExc_TypeError, "take_rows: values and seqs must be dicts, subtree "
                        "bytes, reserved a tuple of bytes");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(reserved); i++) {
        if (!PyBytes_Check(PyTuple_GET_ITEM(reserved, i))) {
            PyErr_SetString(PyExc_TypeError, "take_rows: reserved must hold bytes");
            return NULL;
        }
    }
    const char *sub = PyBytes_AS_STRING(subtree);
    Py_ssize_t sublen = PyBytes_GET_SIZE(subtree);
    Py_ssize_t n = 0;
    PyObject *left = NULL;
    while (n < limit) {
        zmsg_t m[5];
        int k = 0, more = 1, err = 0;
        while (more && k < 5) {
            z_msg_init(&m[k]);
            int rc = recv_raw(sock, Z_NOBLOCK, &m[k], &err);
            if (rc < 0 && err == EAGAIN && k > 0)
                rc = recv_raw(sock, 0, &m[k], &err); /* the rest of a message (see recv_message) */
            if (rc < 0) {
                z_msg_close(&m[k]);
                for (int i = 0; i < k; i++)
                    z_msg_close(&m[i]);
                if (k == 0 && err == EAGAIN)
                    goto out;
                return err ? raise_zmq(err) : NULL;
            }
            more = z_msg_more(&m[k]);
            k++;
        }
        if (k == 5 && !more && plain_row(m, sub, sublen, max_key, max_value, reserved)) {
            int rc = install_row(m, values, seqs, keep_empty);
            for (int i = 0; i < 5; i++)
                z_msg_close(&m[i]);
            if (rc < 0)
                return NULL;
            n++;
            continue;
        }
        left = rest_of_message(sock, m, k, more, max_frames, &err);
        if (left == NULL)
            return err ? raise_zmq(err) : NULL;
        break;
    }
out:
    return Py_BuildValue("(nN)", n, left != NULL ? left : Py_NewRef(Py_None));
}

/* One frame sent, retried on EINTR; a blocking send lets other threads run meanwhile.
 * 0, or -1 with *err the errno (0 when a signal handler raised on EINTR: a Python error
 * is set). */
static int send_part(void *sock, const char *data, size_t size, int flags, int *err) {
    for (;;) {
        int rc;
        if (flags & Z_NOBLOCK) {
            rc = z_send(sock, data, size, flags);
        } else {
            Py_BEGIN_ALLOW_THREADS
            rc = z_send(sock, data, size, flags);
            Py_END_ALLOW_THREADS
        }
        if (rc >= 0)
            return 0;
        int e = z_errno();
        if (e == EINTR && PyErr_CheckSignals() == 0)
            continue;
        *err = e == EINTR ? 0 : e;
        return -1;
    }
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
        int err = 0;
        if (send_part(sock, data, (size_t)size, f, &err) < 0) {
            last_send_errno = err ? err : EINTR;
            if (err)
                raise_zmq(err);
            result = -1;
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

/* send_rows(handle, identity, keys, values, seqs, props, start, stop) -> next: a ROUTER's
 * snapshot rows from columns (the store's own lists: no tuple and no packed sequence per
 * row), row i sent as [identity, keys[i], seqs[i] as 8 bytes big-endian, "", props or
 * props[i], values[i]], non-blocking, from start to stop - 1. `props` is one bytes for
 * every row, or a list. Returns the index of the first row not sent: stop, or earlier
 * where the peer's pipe is at its high-water mark (EAGAIN comes only at a message's first
 * frame: no row is ever half sent). Any other error raises (the rows before it were
 * sent). One C call per chunk instead of six Python calls per row. */
static PyObject *zf_send_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "send_rows(handle, identity, keys, values, seqs, props, start, stop)");
        return NULL;
    }
    if (!check_bound())
        return NULL;
    void *sock = PyLong_AsVoidPtr(args[0]);
    Py_ssize_t start = PyLong_AsSsize_t(args[6]);
    Py_ssize_t stop = PyLong_AsSsize_t(args[7]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *identity = args[1], *keys = args[2], *values = args[3], *seqs = args[4];
    PyObject *props = args[5];
    if (!PyBytes_Check(identity) || !PyList_CheckExact(keys) || !PyList_CheckExact(values)
        || !PyList_CheckExact(seqs) || !(PyBytes_Check(props) || PyList_CheckExact(props))) {
        PyErr_SetString(PyExc_TypeError, "send_rows: identity must be bytes, keys, values "
                        "and seqs lists, props bytes or a list");
        return NULL;
    }
    PyObject *held[5] = {identity, keys, values, seqs, props};
    for (int j = 0; j < 5; j++)
        Py_INCREF(held[j]);
    Py_ssize_t i = start < 0 ? 0 : start;
    PyObject *result = NULL;
    for (; i < stop; i++) {
        if (i >= PyList_GET_SIZE(keys) || i >= PyList_GET_SIZE(values)
            || i >= PyList_GET_SIZE(seqs)
            || (PyList_CheckExact(props) && i >= PyList_GET_SIZE(props)))
            break;
        PyObject *row[3] = {PyList_GET_ITEM(keys, i), PyList_GET_ITEM(values, i),
                            PyList_CheckExact(props) ? PyList_GET_ITEM(props, i) : props};
        if (!PyBytes_Check(row[0]) || !PyBytes_Check(row[1]) || !PyBytes_Check(row[2])) {
            PyErr_Format(PyExc_TypeError, "row %zd: key, value and props must be bytes", i);
            goto done;
        }
        unsigned long long number = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(seqs, i));
        if (number == (unsigned long long)-1 && PyErr_Occurred())
            goto done;
        unsigned char seq[8];
        for (int j = 7; j >= 0; j--, number >>= 8)
            seq[j] = (unsigned char)(number & 0xff);
        for (int j = 0; j < 3; j++)
            Py_INCREF(row[j]); /* a signal handler run on EINTR may change the lists */
        const char *data[6] = {PyBytes_AS_STRING(identity), PyBytes_AS_STRING(row[0]),
                               (const char *)seq, "", PyBytes_AS_STRING(row[2]),
                               PyBytes_AS_STRING(row[1])};
        size_t size[6] = {(size_t)PyBytes_GET_SIZE(identity), (size_t)PyBytes_GET_SIZE(row[0]),
                          8, 0, (size_t)PyBytes_GET_SIZE(row[2]),
                          (size_t)PyBytes_GET_SIZE(row[1])};
        int err = 0, rc = 0, j = 0;
        for (; j < 6 && rc == 0; j++)
            rc = send_part(sock, data[j], size[j], j < 5 ? (Z_NOBLOCK | Z_SNDMORE) : Z_NOBLOCK,
                           &err);
        for (int k = 0; k < 3; k++)
            Py_DECREF(row[k]);
        if (rc < 0) {
            if (err == EAGAIN && j == 1)
                break; /* the pipe is full: nothing of this row went out */
            if (err)
                raise_zmq(err);
            goto done;
        }
    }
    result = PyLong_FromSsize_t(i);
done:
    for (int j = 0; j < 5; j++)
        Py_DECREF(held[j]);
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

/* viewed_get(view, slow) -> get: the client's get over its flat read view
 * (clonemap.client.clone._viewed_get), as a builtin: get(key, default=None) is one
 * dict lookup for a str key the view holds, and anything else (a key it does not hold,
 * not a str, arguments that are not (key[, default]), every key once the client failed
 * and emptied the view) is slow called as get was, which checks the key, raises or
 * returns the default. A Python
 * closure doing the same costs a frame per call: 71 ns a hit against 46 ns here and
 * 44 ns for dict.get (100,000 keys, this 2-core host). The function's self is the tuple
 * (view, slow). */
static PyObject *vg_get(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                        PyObject *kwnames) {
    Py_ssize_t keywords = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (nargs >= 1 && nargs + keywords <= 2 && PyUnicode_Check(args[0])
        && (keywords == 0 || (nargs == 1 && PyUnicode_CompareWithASCIIString(
                                  PyTuple_GET_ITEM(kwnames, 0), "default") == 0))) {
        PyObject *value = PyDict_GetItemWithError(PyTuple_GET_ITEM(self, 0), args[0]);
        if (value != NULL)
            return Py_NewRef(value);
        if (PyErr_Occurred())
            return NULL;
    }
    return PyObject_Vectorcall(PyTuple_GET_ITEM(self, 1), args, nargs, kwnames);
}

static PyMethodDef vg_def = {
    "get", (PyCFunction)(void (*)(void))vg_get, METH_FASTCALL | METH_KEYWORDS,
    "get($self, key, default=None, /)\n--\n\n"
    "key's value in the local map, or default: one dict lookup for a key the map holds "
    "(AsyncClone.get)"};

static PyObject *zf_viewed_get(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyDict_CheckExact(args[0]) || !PyCallable_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "viewed_get(view: dict, slow: callable)");
        return NULL;
    }
    PyObject *bound = PyTuple_Pack(2, args[0], args[1]);
    if (bound == NULL)
        return NULL;
    PyObject *get = PyCFunction_NewEx(&vg_def, bound, NULL);
    Py_DECREF(bound);
    return get;
}

/* The send guard (guard_send, send_refusals).
 *
 * libzmq 4.3.5's tcp_write, which its I/O thread calls for every TCP send, asserts that
 * send() did not fail with EACCES, and aborts the process when it did. Linux fails a
 * send with EACCES on a connection whose route became "prohibit" (or a firewall
 * rejected it that way) once TCP_USER_TIMEOUT gives up on it: the error the
 * retransmissions met becomes the socket's error. Whether recv() or send() meets it
 * first is a race in libzmq's I/O thread (a heartbeat's PING, or a speculative write
 * after a message is queued, can come before the poller's error event), so a process
 * cut off from a peer that way aborted some of the time.
 *
 * guard_send points libzmq's own import of send() (its GOT entry) at guarded_send,
 * which calls the C library's send and turns EACCES into EHOSTUNREACH: an error libzmq
 * treats as a dead peer, closing the connection and reconnecting. Nothing else in the
 * process is touched: only libzmq's calls to send go through the wrapper. */
#if defined(__linux__) && (defined(__x86_64__) || defined(__aarch64__))
#define SEND_GUARD 1
#if defined(__x86_64__)
#define R_PLT_SLOT R_X86_64_JUMP_SLOT
#define R_DATA_SLOT R_X86_64_GLOB_DAT
#else
#define R_PLT_SLOT R_AARCH64_JUMP_SLOT
#define R_DATA_SLOT R_AARCH64_GLOB_DAT
#endif

static ssize_t (*libc_send)(int, const void *, size_t, int) = NULL;
static unsigned long long refusals = 0;

static ssize_t guarded_send(int fd, const void *buf, size_t len, int flags) {
    ssize_t n = libc_send(fd, buf, len, flags);
    if (n == -1 && errno == EACCES) {
        __atomic_add_fetch(&refusals, 1, __ATOMIC_RELAXED);
        errno = EHOSTUNREACH;
    }
    return n;
}

struct loaded {
    uintptr_t inside;         /* an address in the object sought */
    uintptr_t base;           /* its load bias */
    const ElfW(Phdr) *phdr;
    int phnum;
    int found;
};

static int find_loaded(struct dl_phdr_info *info, size_t size, void *data) {
    struct loaded *want = data;
    (void)size;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *p = &info->dlpi_phdr[i];
        uintptr_t lo = info->dlpi_addr + p->p_vaddr;
        if (p->p_type == PT_LOAD && want->inside >= lo && want->inside < lo + p->p_memsz) {
            want->base = info->dlpi_addr;
            want->phdr = info->dlpi_phdr;
            want->phnum = info->dlpi_phnum;
            want->found = 1;
            return 1;
        }
    }
    return 0;
}

/* One GOT slot set to value. A slot in the RELRO range (full RELRO: read-only once the
 * loader is done) is made writable for the store and read-only again after. */
static int set_slot(void **slot, void *value, uintptr_t relro_lo, uintptr_t relro_hi) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t start = (uintptr_t)slot & ~(page - 1);
    int sealed = (uintptr_t)slot >= relro_lo && (uintptr_t)slot < relro_hi;
    if (sealed && mprotect((void *)start, page, PROT_READ | PROT_WRITE) != 0)
        return -1;
    __atomic_store_n(slot, value, __ATOMIC_SEQ_CST);
    if (sealed)
        mprotect((void *)start, page, PROT_READ);
    return 0;
}

/* The relocations in [rel, rel + bytes) that bind the import `send`, pointed at
 * guarded_send; returns how many (already guarded ones included), or -1 (errno). */
static int guard_relocations(uintptr_t base, const ElfW(Rela) *rel, size_t bytes,
                             const ElfW(Sym) *symtab, const char *strtab, size_t strsz,
                             uintptr_t relro_lo, uintptr_t relro_hi) {
    int guarded = 0;
    for (size_t i = 0; rel != NULL && i < bytes / sizeof *rel; i++) {
        unsigned long type = ELF64_R_TYPE(rel[i].r_info);
        if (type != R_PLT_SLOT && type != R_DATA_SLOT)
            continue;
        const ElfW(Sym) *sym = &symtab[ELF64_R_SYM(rel[i].r_info)];
        if (sym->st_shndx != SHN_UNDEF || sym->st_name >= strsz ||
            strcmp(strtab + sym->st_name, "send") != 0)
            continue;
        void **slot = (void **)(base + rel[i].r_offset);
        if (*slot != (void *)guarded_send &&
            set_slot(slot, (void *)guarded_send, relro_lo, relro_hi) != 0)
            return -1;
        guarded++;
    }
    return guarded;
}

static PyObject *zf_guard_send(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path))
        return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    void *inside = lib == NULL ? NULL : dlsym(lib, "zmq_send");
    if (inside == NULL) {
        PyErr_Format(PyExc_ImportError, "%s is not a loaded libzmq", path);
        return NULL;
    }
    if (libc_send == NULL)
        *(void **)(&libc_send) = dlsym(RTLD_DEFAULT, "send");
    if (libc_send == NULL) {
        PyErr_SetString(PyExc_ImportError, "the C library's send was not found");
        return NULL;
    }
    struct loaded obj = {(uintptr_t)inside, 0, NULL, 0, 0};
    dl_iterate_phdr(find_loaded, &obj);
    if (!obj.found) {
        PyErr_Format(PyExc_ImportError, "%s: its program headers were not found", path);
        return NULL;
    }
    const ElfW(Dyn) *dyn = NULL;
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), relro_lo = 0, relro_hi = 0;
    for (int i = 0; i < obj.phnum; i++) {
        const ElfW(Phdr) *p = &obj.phdr[i];
        if (p->p_type == PT_DYNAMIC)
            dyn = (const ElfW(Dyn) *)(obj.base + p->p_vaddr);
        if (p->p_type == PT_GNU_RELRO) { /* the loader seals whole pages only */
            relro_lo = (obj.base + p->p_vaddr) & ~(page - 1);
            relro_hi = (obj.base + p->p_vaddr + p->p_memsz) & ~(page - 1);
        }
    }
    if (dyn == NULL) {
        PyErr_Format(PyExc_ImportError, "%s has no dynamic section", path);
        return NULL;
    }
    /* The loader has rebased some of these in place on some platforms and not others:
     * a value below the load bias is still an offset. */
#define AT(v) ((uintptr_t)(v) < obj.base ? obj.base + (uintptr_t)(v) : (uintptr_t)(v))
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const ElfW(Rela) *plt = NULL, *rela = NULL;
    size_t strsz = 0, plt_bytes = 0, rela_bytes = 0;
    long plt_kind = DT_RELA;
    for (; dyn->d_tag != DT_NULL; dyn++) {
        switch (dyn->d_tag) {
        case DT_SYMTAB: symtab = (const ElfW(Sym) *)AT(dyn->d_un.d_ptr); break;
        case DT_STRTAB: strtab = (const char *)AT(dyn->d_un.d_ptr); break;
        case DT_STRSZ: strsz = dyn->d_un.d_val; break;
        case DT_JMPREL: plt = (const ElfW(Rela) *)AT(dyn->d_un.d_ptr); break;
        case DT_PLTRELSZ: plt_bytes = dyn->d_un.d_val; break;
        case DT_PLTREL: plt_kind = (long)dyn->d_un.d_val; break;
        case DT_RELA: rela = (const ElfW(Rela) *)AT(dyn->d_un.d_ptr); break;
        case DT_RELASZ: rela_bytes = dyn->d_un.d_val; break;
        }
    }
#undef AT
    if (symtab == NULL || strtab == NULL || plt_kind != DT_RELA) {
        PyErr_Format(PyExc_ImportError, "%s: an unexpected relocation layout", path);
        return NULL;
    }
    int a = guard_relocations(obj.base, plt, plt_bytes, symtab, strtab, strsz, relro_lo,
                              relro_hi);
    int b = a < 0 ? a : guard_relocations(obj.base, rela, rela_bytes, symtab, strtab,
                                          strsz, relro_lo, relro_hi);
    if (a < 0 || b < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(a + b);
}

static PyObject *zf_send_refusals(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&refusals, __ATOMIC_RELAXED));
}
#endif /* the send guard */

static PyMethodDef methods[] = {
#ifdef SEND_GUARD
    {"guard_send", zf_guard_send, METH_VARARGS,
     "guard_send(libzmq_path) -> slots: libzmq's send() turns EACCES into EHOSTUNREACH"},
    {"send_refusals", zf_send_refusals, METH_NOARGS,
     "send_refusals() -> count: libzmq's sends that failed with EACCES"},
#endif
    {"viewed_get", (PyCFunction)(void (*)(void))zf_viewed_get, METH_FASTCALL,
     "viewed_get(view, slow) -> get: one dict lookup for a str key in view, else slow"},
    {"untrack", zf_untrack, METH_O,
     "untrack(frames) -> frames: a list of bytes off the cyclic GC's lists"},
    {"send_many", (PyCFunction)(void (*)(void))zf_send_many, METH_FASTCALL,
     "send_many(handle, messages, width=0) -> sent"},
    {"send_rows", (PyCFunction)(void (*)(void))zf_send_rows, METH_FASTCALL,
     "send_rows(handle, identity, keys, values, seqs, props, start, stop) -> next"},
    {"bind", zf_bind, METH_VARARGS,
     "bind(libzmq_path, error_of_errno): resolve libzmq's calls"},
    {"recv", (PyCFunction)(void (*)(void))zf_recv, METH_FASTCALL,
     "recv(handle, flags, max_frames) -> list[bytes] | None"},
    {"drain_users", (PyCFunction)(void (*)(void))zf_drain_users, METH_FASTCALL,
     "drain_users(handle, owner, limit, max_frames, handler) -> (n, exc, frames): drain, "
     "calling handler(frames, user_id)"},
    {"drain", (PyCFunction)(void (*)(void))zf_drain, METH_FASTCALL,
     "drain(handle, owner, limit, max_frames, handler) -> (n, exc, frames)"},
    {"take_rows", (PyCFunction)(void (*)(void))zf_take_rows, METH_FASTCALL,
     "take_rows(handle, limit, max_frames, values, seqs, subtree, max_key, max_value, "
     "reserved, keep_empty) -> (n, frames)"},
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
