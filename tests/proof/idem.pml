/*
 * idem.pml: the per-key state machine of docs/design.md, as src/redis/lua/record.lua runs it,
 * checked exhaustively by spin for NC consumers on one key. docs/proof.md says what is modelled,
 * what is abstracted and how each step maps to a script.
 *
 * Every store step is one `atomic` block: a Lua script runs alone on the server (and the
 * MemoryStore / PostgresStore steps are one mutex / one statement), so nothing interleaves inside
 * one. Between steps anything may happen: spin tries every interleaving, so a consumer that is
 * not scheduled for a while is a paused holder (GC, SIGSTOP) that resumes at any later point.
 *
 * Compile-time switches (spin -a -DNAME):
 *   MUT_NO_TOKEN  complete checks the fence only (a recreated record's fence 1 matches)
 *   MUT_NO_FENCE  complete checks the token only (a token seen earlier in this lifetime matches)
 * Each must make an assertion fail; without them none may.
 */

#ifndef NC
#define NC 3          /* consumers */
#endif
#ifndef MAXACQ
#define MAXACQ 4      /* acquisitions granted in one run of the model, over every lifetime */
#endif
#ifndef NTOK
#define NTOK 4        /* token values the consumers draw from */
#endif
#ifndef RUNS
#define RUNS 2        /* deliveries of the message to each consumer */
#endif

#define ABSENT 0
#define INPROG 1
#define DONE 2
#define FAILED 3

#ifdef MUT_NO_FENCE
#define FENCE_OK(g) true
#else
#define FENCE_OK(g) (rec.gen == (g))
#endif
#ifdef MUT_NO_TOKEN
#define TOKEN_OK(t) true
#else
#define TOKEN_OK(t) (rec.tok == (t))
#endif
/* of_holder in record.lua: the record's latest holder is (g, t), in any state. */
#define OF_HOLDER(g, t) (rec.st != ABSENT && FENCE_OK(g) && TOKEN_OK(t))
#define BIT(t) (1 << ((t) - 1))

/* The record as record.lua stores it; lease_until and retry_at become "has the store clock passed
   them yet" (live, retry_ok), which is all any script decides on. */
typedef Record {
  byte st;        /* ABSENT, INPROG, DONE, FAILED */
  byte gen;       /* the fence */
  byte tok;       /* token of the latest acquisition */
  bool live;      /* INPROG: lease_until > now on the store clock */
  bool perm;      /* FAILED: permanent */
  bool retry_ok;  /* FAILED: retry_at <= now */
  byte res;       /* DONE: the result (each acquisition's result is its own id) / FAILED: the error */
};
Record rec;

/* Ghost state: what really happened, kept apart from what the record says, so the assertions
   do not trust the very fields a mutant stops checking. */
byte nacq;                  /* acquisitions granted; each gets id nacq (1..MAXACQ) */
byte rec_acq;               /* the acquisition the record currently belongs to */
bool glive[MAXACQ + 1];     /* acquisition i holds a lease the store clock has not passed */
byte used_now;              /* tokens of this lifetime of the record (bits) */
byte used_before;           /* tokens of earlier lifetimes (bits) */
bool retained_done;         /* the key completed and the record is still retained */
byte done_res, done_gen;    /* what it completed with */
bool after_done[MAXACQ + 1]; /* acquisition i was granted while the key was completed and retained */
byte effects_done;          /* handler runs (effects) of such acquisitions: must stay 0 */
byte scratch;

/* Invariants 1 and 2 of docs/design.md, after every step. Invariant 3 is asserted inside each
   holder-checked write (a write that is accepted must come from the record's own acquisition). */
inline check() {
  scratch = 0;
  for (i : 1 .. MAXACQ) { scratch = scratch + glive[i] };
  assert(scratch <= 1);                                                        /* invariant 1 */
  scratch = 0;
  assert(!retained_done || (rec.st == DONE && rec.res == done_res && rec.gen == done_gen)); /* invariant 2 */
  assert(effects_done == 0);                          /* a completed key never runs again while retained */
}

/* acquire.lua / acquire_key. A fresh token never repeats one of an earlier lifetime of the key
   (the token's job: 64 random bits) nor the one the record holds now (that would be this very
   acquisition asked again); it may repeat an older token of this lifetime, which the fence has to
   tell apart. Sets `got` to 1 acquired, 0 anything else (in_flight, duplicate, previously_failed,
   or the model's bound on acquisitions reached). */
inline acquire(my_gen, my_tok, my_acq, got) {
  atomic {
    if
    :: nacq < MAXACQ && ((used_before | used_now) & BIT(1)) == 0 -> t = 1
    :: nacq < MAXACQ && ((used_before | used_now) & BIT(1)) != 0 && ((used_before | used_now) & BIT(2)) == 0 -> t = 2
    :: nacq < MAXACQ && ((used_before | used_now) & (BIT(1) | BIT(2))) == (BIT(1) | BIT(2)) &&
       ((used_before | used_now) & BIT(3)) == 0 -> t = 3
    :: nacq < MAXACQ && ((used_before | used_now) & (BIT(1) | BIT(2) | BIT(3))) == (BIT(1) | BIT(2) | BIT(3)) &&
       ((used_before | used_now) & BIT(4)) == 0 -> t = 4
    :: nacq < MAXACQ && (used_now & BIT(1)) != 0 && rec.tok != 1 -> t = 1
    :: nacq < MAXACQ && (used_now & BIT(2)) != 0 && rec.tok != 2 -> t = 2
    :: nacq < MAXACQ && (used_now & BIT(3)) != 0 && rec.tok != 3 -> t = 3
    :: nacq >= MAXACQ -> t = 0                               /* the bound: no token needed */
    fi;
    got = 0;
    if
    :: nacq >= MAXACQ -> skip                                 /* bound of the model: no more grants */
    :: nacq < MAXACQ && rec.st == ABSENT -> rec.gen = 1; got = 1
    :: nacq < MAXACQ && rec.st == DONE -> skip                /* duplicate */
    :: nacq < MAXACQ && rec.st == INPROG && rec.tok == t -> got = 2   /* this acquisition asked again */
    :: nacq < MAXACQ && rec.st == INPROG && rec.tok != t && rec.live -> skip   /* in_flight */
    :: nacq < MAXACQ && rec.st == INPROG && rec.tok != t && !rec.live -> rec.gen = rec.gen + 1; got = 1 /* takeover */
    :: nacq < MAXACQ && rec.st == FAILED && rec.perm -> skip  /* previously_failed */
    :: nacq < MAXACQ && rec.st == FAILED && !rec.perm && !rec.retry_ok -> skip /* in_flight (backoff) */
    :: nacq < MAXACQ && rec.st == FAILED && !rec.perm && rec.retry_ok -> rec.gen = rec.gen + 1; got = 1
    fi;
    if
    :: got == 2 -> assert(false)                              /* unreachable under the token rule above */
    :: got == 1 ->
       assert(!retained_done);                               /* never acquired while completed */
       nacq++;
       after_done[nacq] = retained_done;
       rec.st = INPROG; rec.tok = t; rec.live = true; rec.perm = false; rec.retry_ok = false; rec.res = 0;
       rec_acq = nacq; glive[nacq] = true; used_now = used_now | BIT(t);
       my_gen = rec.gen; my_tok = t; my_acq = nacq;
       printf("MSG: consumer %d acquired: fence %d token %d (acquisition %d)\n", _pid, my_gen, my_tok, my_acq)
    :: else -> skip
    fi;
    t = 0;
    check()
  }
}

/* complete.lua / complete_key (the fast path decides exactly as the decoding path). `ok` is the
   reply: 1 written or already written by this very request, 0 lease lost. */
inline complete(my_gen, my_tok, my_acq, ok) {
  atomic {
    ok = 0;
    if
    :: OF_HOLDER(my_gen, my_tok) && rec.st == DONE && rec.res == my_acq -> ok = 1  /* asked again: done */
    :: OF_HOLDER(my_gen, my_tok) && rec.st == INPROG ->
       printf("MSG: consumer %d completes with fence %d token %d, record fence %d token %d\n", _pid, my_gen, my_tok,
              rec.gen, rec.tok);
       assert(rec_acq == my_acq);                             /* invariant 3 */
       glive[my_acq] = false;
       rec.st = DONE; rec.res = my_acq; rec.live = false;
       retained_done = true; done_res = my_acq; done_gen = rec.gen;
       ok = 1
    :: else -> skip
    fi;
    ok = 0;
    check()
  }
}

/* fail.lua: release (retry at once), record with backoff, or record permanent. */
inline fail(my_gen, my_tok, my_acq, release, permanent, ok) {
  atomic {
    ok = 0;
    if
    :: OF_HOLDER(my_gen, my_tok) && rec.st == FAILED && rec.res == my_acq &&
       rec.perm == (!release && permanent) -> ok = 1         /* asked again: done */
    :: OF_HOLDER(my_gen, my_tok) && rec.st == INPROG ->
       printf("MSG: consumer %d fails (release %d, permanent %d)\n", _pid, release, permanent);
       assert(rec_acq == my_acq);                             /* invariant 3 */
       glive[my_acq] = false;
       rec.st = FAILED; rec.res = my_acq; rec.live = false;
       rec.perm = (!release && permanent);
       rec.retry_ok = release;                                /* release: retry_at = now */
       ok = 1
    :: else -> skip
    fi;
    ok = 0;
    check()
  }
}

/* extend.lua: only a live holder (in_progress, fence and token equal); the retention never ends
   before the new lease (PX max(ttl, lease)), which the clock below respects. */
inline extend(my_gen, my_tok, my_acq, ok) {
  atomic {
    ok = 0;
    if
    :: rec.st == INPROG && rec.gen == my_gen && rec.tok == my_tok ->
       assert(rec_acq == my_acq);                             /* invariant 3 */
       rec.live = true; glive[my_acq] = true; ok = 1
    :: else -> skip
    fi;
    ok = 0;
    check()
  }
}

/* The store clock: a lease lapses, a backoff ends, the retention ends (Redis expires the key,
   MemoryStore / PostgreSQL treat it as absent). Time is abstract: each event may happen at any
   point between steps, in any order the durations allow. */
active proctype store_clock() {
  byte i;
end:
  do
  :: atomic { rec.st == INPROG && rec.live -> rec.live = false; glive[rec_acq] = false; check();
              printf("MSG: the lease of fence %d lapses\n", rec.gen) }
  :: atomic { rec.st == FAILED && !rec.perm && !rec.retry_ok -> rec.retry_ok = true; check() }
  :: atomic {
       /* the retention is at least the lease, so a live lease keeps its record */
       rec.st != ABSENT && !(rec.st == INPROG && rec.live) ->
       printf("MSG: the record (fence %d) expires\n", rec.gen);
       rec.st = ABSENT; rec.gen = 0; rec.tok = 0; rec.live = false; rec.perm = false; rec.retry_ok = false;
       rec.res = 0; rec_acq = 0;
       for (i : 1 .. MAXACQ) { glive[i] = false };           /* every lease of that lifetime ended before it */
       i = 0;
       retained_done = false;
       used_before = used_before | used_now; used_now = 0;
       check()
     }
  od
}

/* One consumer: RUNS deliveries of the same message. Each delivery acquires; a holder runs the
   handler (its effect), heartbeats any number of times, then completes, fails (release, record,
   or permanent) or crashes. A crash may come at any step: the holder just never sends again. A
   lost reply to complete makes the client send the same complete once more. */
proctype consumer() {
  byte i, t, got, ok, deliveries;
  byte my_gen, my_tok, my_acq;
  do
  :: deliveries < RUNS ->
     deliveries++;
     acquire(my_gen, my_tok, my_acq, got);
     if
     :: got == 1 ->
        if
        :: true -> atomic { if :: after_done[my_acq] -> effects_done++ :: else -> skip fi; check() } /* the effect */
        :: true -> goto crashed                               /* crash before the handler */
        fi;
        do
        :: extend(my_gen, my_tok, my_acq, ok)
        :: complete(my_gen, my_tok, my_acq, ok);
           if
           :: complete(my_gen, my_tok, my_acq, ok)            /* the reply was lost: asked again */
           :: skip
           fi;
           break
        :: fail(my_gen, my_tok, my_acq, 1, 0, ok); break     /* policy release */
        :: fail(my_gen, my_tok, my_acq, 0, 0, ok); break     /* policy record, with backoff */
        :: fail(my_gen, my_tok, my_acq, 0, 1, ok); break     /* policy record, permanent */
        :: break                                             /* crash */
        od
     :: else -> skip
     fi;
crashed:
     my_gen = 0; my_tok = 0; my_acq = 0; got = 0; ok = 0
  :: else -> break
  od
}

init {
  byte n;
  atomic {
    for (n : 1 .. NC) { run consumer() }
  }
}
