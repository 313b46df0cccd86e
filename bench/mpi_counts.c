/* PMPI shim for bench/scaling_projection.py --loop: counts this process's MPI traffic.
 *
 * Built by the benchmark with ``mpicc -shared -fPIC`` and loaded with LD_PRELOAD; Python
 * reads and resets the counters through ctypes (mpi_counts_get / mpi_counts_reset).
 * Counted: reductions (Allreduce, Iallreduce, Reduce, Scan, Exscan), other collectives
 * (Bcast, Barrier, Allgather(v), Alltoall(v), Gather(v), Scatter(v)), and point-to-point
 * sends (Send, Isend, Ssend, Issend, Rsend, and persistent sends started with Start /
 * Startall) with their bytes. Every call is forwarded to the PMPI entry point unchanged.
 */
#include <mpi.h>
#include <string.h>

enum { REDUCTIONS, COLLECTIVES, SENDS, SEND_BYTES, NCOUNTS };
static long long counts[NCOUNTS];

#define MAXPERSIST 65536
static MPI_Request persist[MAXPERSIST];
static long long persist_bytes[MAXPERSIST];
static int npersist;

void mpi_counts_get(long long *out) { memcpy(out, counts, sizeof(counts)); }
void mpi_counts_reset(void) { memset(counts, 0, sizeof(counts)); }

static long long nbytes(int count, MPI_Datatype t) {
    int size = 0;
    PMPI_Type_size(t, &size);
    return (long long)count * size;
}

static void sent(int count, MPI_Datatype t) {
    counts[SENDS]++;
    counts[SEND_BYTES] += nbytes(count, t);
}

int MPI_Allreduce(const void *s, void *r, int c, MPI_Datatype t, MPI_Op o, MPI_Comm m) {
    counts[REDUCTIONS]++;
    return PMPI_Allreduce(s, r, c, t, o, m);
}
int MPI_Iallreduce(const void *s, void *r, int c, MPI_Datatype t, MPI_Op o, MPI_Comm m, MPI_Request *q) {
    counts[REDUCTIONS]++;
    return PMPI_Iallreduce(s, r, c, t, o, m, q);
}
int MPI_Reduce(const void *s, void *r, int c, MPI_Datatype t, MPI_Op o, int root, MPI_Comm m) {
    counts[REDUCTIONS]++;
    return PMPI_Reduce(s, r, c, t, o, root, m);
}
int MPI_Scan(const void *s, void *r, int c, MPI_Datatype t, MPI_Op o, MPI_Comm m) {
    counts[REDUCTIONS]++;
    return PMPI_Scan(s, r, c, t, o, m);
}
int MPI_Exscan(const void *s, void *r, int c, MPI_Datatype t, MPI_Op o, MPI_Comm m) {
    counts[REDUCTIONS]++;
    return PMPI_Exscan(s, r, c, t, o, m);
}
int MPI_Bcast(void *b, int c, MPI_Datatype t, int root, MPI_Comm m) {
    counts[COLLECTIVES]++;
    return PMPI_Bcast(b, c, t, root, m);
}
int MPI_Barrier(MPI_Comm m) {
    counts[COLLECTIVES]++;
    return PMPI_Barrier(m);
}
int MPI_Allgather(const void *s, int sc, MPI_Datatype st, void *r, int rc, MPI_Datatype rt, MPI_Comm m) {
    counts[COLLECTIVES]++;
    return PMPI_Allgather(s, sc, st, r, rc, rt, m);
}
int MPI_Allgatherv(const void *s, int sc, MPI_Datatype st, void *r, const int rc[], const int d[],
                   MPI_Datatype rt, MPI_Comm m) {
    counts[COLLECTIVES]++;
    return PMPI_Allgatherv(s, sc, st, r, rc, d, rt, m);
}
int MPI_Alltoall(const void *s, int sc, MPI_Datatype st, void *r, int rc, MPI_Datatype rt, MPI_Comm m) {
    counts[COLLECTIVES]++;
    return PMPI_Alltoall(s, sc, st, r, rc, rt, m);
}
int MPI_Alltoallv(const void *s, const int sc[], const int sd[], MPI_Datatype st, void *r, const int rc[],
                  const int rd[], MPI_Datatype rt, MPI_Comm m) {
    counts[COLLECTIVES]++;
    return PMPI_Alltoallv(s, sc, sd, st, r, rc, rd, rt, m);
}
int MPI_Gather(const void *s, int sc, MPI_Datatype st, void *r, int rc, MPI_Datatype rt, int root, MPI_Comm m) {
    counts[COLLECTIVES]++;
    return PMPI_Gather(s, sc, st, r, rc, rt, root, m);
}
int MPI_Gatherv(const void *s, int sc, MPI_Datatype st, void *r, const int rc[], const int d[], MPI_Datatype rt,
                int root, MPI_Comm m) {
    counts[COLLECTIVES]++;
    return PMPI_Gatherv(s, sc, st, r, rc, d, rt, root, m);
}
int MPI_Scatter(const void *s, int sc, MPI_Datatype st, void *r, int rc, MPI_Datatype rt, int root, MPI_Comm m) {
    counts[COLLECTIVES]++;
    return PMPI_Scatter(s, sc, st, r, rc, rt, root, m);
}
int MPI_Scatterv(const void *s, const int sc[], const int d[], MPI_Datatype st, void *r, int rc, MPI_Datatype rt,
                 int root, MPI_Comm m) {
    counts[COLLECTIVES]++;
    return PMPI_Scatterv(s, sc, d, st, r, rc, rt, root, m);
}
int MPI_Send(const void *b, int c, MPI_Datatype t, int d, int tag, MPI_Comm m) {
    sent(c, t);
    return PMPI_Send(b, c, t, d, tag, m);
}
int MPI_Ssend(const void *b, int c, MPI_Datatype t, int d, int tag, MPI_Comm m) {
    sent(c, t);
    return PMPI_Ssend(b, c, t, d, tag, m);
}
int MPI_Rsend(const void *b, int c, MPI_Datatype t, int d, int tag, MPI_Comm m) {
    sent(c, t);
    return PMPI_Rsend(b, c, t, d, tag, m);
}
int MPI_Isend(const void *b, int c, MPI_Datatype t, int d, int tag, MPI_Comm m, MPI_Request *q) {
    sent(c, t);
    return PMPI_Isend(b, c, t, d, tag, m, q);
}
int MPI_Issend(const void *b, int c, MPI_Datatype t, int d, int tag, MPI_Comm m, MPI_Request *q) {
    sent(c, t);
    return PMPI_Issend(b, c, t, d, tag, m, q);
}
int MPI_Send_init(const void *b, int c, MPI_Datatype t, int d, int tag, MPI_Comm m, MPI_Request *q) {
    int rc = PMPI_Send_init(b, c, t, d, tag, m, q);
    if (npersist < MAXPERSIST) {
        persist[npersist] = *q;
        persist_bytes[npersist++] = nbytes(c, t);
    }
    return rc;
}

static void started(MPI_Request q) {
    for (int i = npersist - 1; i >= 0; i--)
        if (persist[i] == q) {
            counts[SENDS]++;
            counts[SEND_BYTES] += persist_bytes[i];
            return;
        }
}
int MPI_Start(MPI_Request *q) {
    started(*q);
    return PMPI_Start(q);
}
int MPI_Startall(int n, MPI_Request q[]) {
    for (int i = 0; i < n; i++)
        started(q[i]);
    return PMPI_Startall(n, q);
}
int MPI_Request_free(MPI_Request *q) {
    for (int i = 0; i < npersist; i++)
        if (persist[i] == *q) {
            persist[i] = persist[--npersist];
            persist_bytes[i] = persist_bytes[npersist];
            break;
        }
    return PMPI_Request_free(q);
}
