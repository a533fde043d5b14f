// Linked into idem_kafka_consumer in ThreadSanitizer builds only (see examples/CMakeLists.txt).
//
// Debian's librdkafka uses C11 <threads.h> (thrd_create, mtx_lock, cnd_wait, ...). glibc
// implements those on its internal pthread entry points, which GCC 12's libtsan does not
// intercept: TSan then knows neither librdkafka's threads (it crashes at their first intercepted
// call: "ThreadSanitizer: SEGV ... nested bug") nor its locks (every hand-over through a
// librdkafka queue would look like a race). The definitions below take precedence over glibc's
// (the executable's symbols come first) and forward each call to the public pthread function
// TSan does intercept. glibc's C11 types have the size and layout of the pthread ones, and its
// thrd_exit / thrd_join carry the thread's int result as a pointer-sized value, as done here.
#include <pthread.h>
#include <threads.h>

#include <cerrno>
#include <cstdint>
#include <ctime>
#include <new>

static_assert(sizeof(mtx_t) == sizeof(pthread_mutex_t));
static_assert(sizeof(cnd_t) == sizeof(pthread_cond_t));
static_assert(sizeof(once_flag) == sizeof(pthread_once_t));

namespace {
struct Start {
  thrd_start_t fn;
  void* arg;
};
extern "C" void* idem_c11_trampoline(void* p) {
  const Start s = *static_cast<Start*>(p);
  delete static_cast<Start*>(p);
  return reinterpret_cast<void*>(static_cast<std::intptr_t>(s.fn(s.arg)));
}
int map(int rc) {
  switch (rc) {
    case 0:
      return thrd_success;
    case ETIMEDOUT:
      return thrd_timedout;
    case EBUSY:
      return thrd_busy;
    case ENOMEM:
    case EAGAIN:
      return thrd_nomem;
    default:
      return thrd_error;
  }
}
pthread_mutex_t* pm(mtx_t* m) { return reinterpret_cast<pthread_mutex_t*>(m); }
pthread_cond_t* pc(cnd_t* c) { return reinterpret_cast<pthread_cond_t*>(c); }
}  // namespace

extern "C" {

int thrd_create(thrd_t* thr, thrd_start_t fn, void* arg) {
  auto* s = new (std::nothrow) Start{fn, arg};
  if (!s) return thrd_nomem;
  const int rc = pthread_create(thr, nullptr, &idem_c11_trampoline, s);
  if (rc != 0) delete s;
  return map(rc);
}

int thrd_join(thrd_t thr, int* res) {
  void* v = nullptr;
  const int rc = pthread_join(thr, &v);
  if (rc == 0 && res) *res = static_cast<int>(reinterpret_cast<std::intptr_t>(v));
  return map(rc);
}

int thrd_detach(thrd_t thr) { return map(pthread_detach(thr)); }

int mtx_init(mtx_t* m, int type) {
  pthread_mutexattr_t a;
  pthread_mutexattr_init(&a);
  if (type & mtx_recursive) pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);
  const int rc = pthread_mutex_init(pm(m), &a);
  pthread_mutexattr_destroy(&a);
  return map(rc);
}
int mtx_lock(mtx_t* m) { return map(pthread_mutex_lock(pm(m))); }
int mtx_trylock(mtx_t* m) { return map(pthread_mutex_trylock(pm(m))); }
int mtx_timedlock(mtx_t* m, const struct timespec* ts) { return map(pthread_mutex_timedlock(pm(m), ts)); }
int mtx_unlock(mtx_t* m) { return map(pthread_mutex_unlock(pm(m))); }
void mtx_destroy(mtx_t* m) { pthread_mutex_destroy(pm(m)); }

int cnd_init(cnd_t* c) { return map(pthread_cond_init(pc(c), nullptr)); }
int cnd_signal(cnd_t* c) { return map(pthread_cond_signal(pc(c))); }
int cnd_broadcast(cnd_t* c) { return map(pthread_cond_broadcast(pc(c))); }
int cnd_wait(cnd_t* c, mtx_t* m) { return map(pthread_cond_wait(pc(c), pm(m))); }
int cnd_timedwait(cnd_t* c, mtx_t* m, const struct timespec* ts) {
  return map(pthread_cond_timedwait(pc(c), pm(m), ts));
}
void cnd_destroy(cnd_t* c) { pthread_cond_destroy(pc(c)); }

void call_once(once_flag* flag, void (*fn)(void)) { pthread_once(reinterpret_cast<pthread_once_t*>(flag), fn); }

}  // extern "C"
