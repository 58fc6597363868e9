/*
 * The C ABI end to end, from C: a control plane in this process, two trainer processes (this
 * program again, as fsdp:2 slots 0 and 1) publishing a small llama model from malloc'd memory,
 * and this process's puller (tp:2, ranks 0 and 1, every parameter its own malloc'd buffer)
 * staging over NIXL and applying in place, then served as a worker and refitted through the
 * control plane, then rolled back. Every byte of every parameter is compared with what the
 * trainers wrote (generated here, sliced here from the piece descriptions). Bad input from C
 * (NULL handles and strings, a wrong dtype string, a shard outside its memory, ...) must give
 * the right status and a last error naming the culprit.
 *
 *   refit                      run the test (needs NIXL: libmx finds the checkout's .mx/nixl)
 *   refit publish URL SLOT     (internal) one trainer slot
 *
 * Exit status 0 when every check passed.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "mx.h"

static const char *who = "refit";
static int checks = 0;

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: FAILED: ", who);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n");
    exit(1);
}

/* The call must succeed. */
#define OK(call)                                                                                   \
    do {                                                                                           \
        mx_status st_ = (call);                                                                    \
        if (st_ != MX_OK)                                                                          \
            die("%s:%d: %s -> %s: %s", __FILE__, __LINE__, #call, mx_status_name(st_),             \
                mx_last_error());                                                                  \
        checks++;                                                                                  \
    } while (0)

/* The call must fail with `want`, and the last error must contain `needle`. */
#define FAILS(call, want, needle)                                                                  \
    do {                                                                                           \
        mx_status st_ = (call);                                                                    \
        const char *e_ = mx_last_error();                                                          \
        if (st_ != (want))                                                                         \
            die("%s:%d: %s -> %s, wanted %s (%s)", __FILE__, __LINE__, #call,                      \
                mx_status_name(st_), mx_status_name(want), e_);                                    \
        if (!strstr(e_, (needle)))                                                                 \
            die("%s:%d: %s: last error lacks \"%s\": %s", __FILE__, __LINE__, #call, (needle),     \
                e_);                                                                               \
        printf("%s: refused as expected: %s\n", who, e_);                                          \
        checks++;                                                                                  \
    } while (0)

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond))                                                                               \
            die(__VA_ARGS__);                                                                      \
        checks++;                                                                                  \
    } while (0)

/* ---- the model: a small llama (GQA, untied lm_head, vocab padded for tp) ---- */

#define LAYERS 2
#define HIDDEN 64
#define INTER 128
#define HEADS 4
#define KV_HEADS 2
#define HEAD_DIM 16
#define VOCAB 250 /* padded to 256 for tp: rank 1's last rows are padding */
#define MAX_TENSORS (3 + LAYERS * 9)

static const char *CONFIG =
    "{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":128,"
    "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"num_key_value_heads\":2,"
    "\"head_dim\":16,\"vocab_size\":250,\"tie_word_embeddings\":false}";

typedef struct {
    char name[96];
    uint64_t shape[2];
    size_t ndim;
} tensor_t;

static tensor_t tensors[MAX_TENSORS];
static size_t n_tensors = 0;

static void add(const char *name, uint64_t d0, uint64_t d1, size_t ndim) {
    tensor_t *t = &tensors[n_tensors++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->ndim = ndim;
}

static void build_tensors(void) {
    char n[96];
    add("model.embed_tokens.weight", VOCAB, HIDDEN, 2);
    add("lm_head.weight", VOCAB, HIDDEN, 2);
    add("model.norm.weight", HIDDEN, 0, 1);
    for (int l = 0; l < LAYERS; l++) {
#define L(suffix, d0, d1, nd)                                                                      \
    snprintf(n, sizeof n, "model.layers.%d.%s", l, suffix);                                        \
    add(n, d0, d1, nd)
        L("self_attn.q_proj.weight", HEADS * HEAD_DIM, HIDDEN, 2);
        L("self_attn.k_proj.weight", KV_HEADS * HEAD_DIM, HIDDEN, 2);
        L("self_attn.v_proj.weight", KV_HEADS * HEAD_DIM, HIDDEN, 2);
        L("self_attn.o_proj.weight", HIDDEN, HEADS * HEAD_DIM, 2);
        L("mlp.gate_proj.weight", INTER, HIDDEN, 2);
        L("mlp.up_proj.weight", INTER, HIDDEN, 2);
        L("mlp.down_proj.weight", HIDDEN, INTER, 2);
        L("input_layernorm.weight", HIDDEN, 0, 1);
        L("post_attention_layernorm.weight", HIDDEN, 0, 1);
#undef L
    }
}

static mx_model *make_model(void) {
    mx_tensor_spec specs[MAX_TENSORS];
    for (size_t i = 0; i < n_tensors; i++) {
        specs[i].name = tensors[i].name;
        specs[i].dtype = "bfloat16";
        specs[i].shape = tensors[i].shape;
        specs[i].ndim = tensors[i].ndim;
    }
    mx_model *m = NULL;
    OK(mx_model_from_config(CONFIG, specs, n_tensors, &m));
    return m;
}

static size_t tensor_index(const char *name) {
    for (size_t i = 0; i < n_tensors; i++)
        if (strcmp(tensors[i].name, name) == 0)
            return i;
    die("unknown tensor %s", name);
    return 0;
}

/* Byte `b` (0 or 1) of bf16 element `e` (global row-major index) of tensor `t` at training step
 * `step`: what the trainers write and the puller must land. */
static uint8_t gen(size_t t, uint64_t e, int b, int step) {
    uint32_t x = (uint32_t)(t * 2654435761u) ^ (uint32_t)(e * 40503u) ^ (uint32_t)(step * 977u) ^
                 (uint32_t)(b * 131u);
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    return (uint8_t)x;
}

/* ---- trainer slot (child process) ---- */

typedef struct {
    size_t tensor;
    uint64_t row0, rows; /* dim-0 box */
    uint64_t offset;     /* bytes into the arena */
} shard_t;

static void fill(uint8_t *arena, const shard_t *sh, size_t n, int step) {
    for (size_t i = 0; i < n; i++) {
        const tensor_t *t = &tensors[sh[i].tensor];
        uint64_t cols = t->ndim == 2 ? t->shape[1] : 1;
        uint64_t first = sh[i].row0 * cols, count = sh[i].rows * cols;
        for (uint64_t k = 0; k < count; k++)
            for (int b = 0; b < 2; b++)
                arena[sh[i].offset + 2 * k + b] = gen(sh[i].tensor, first + k, b, step);
    }
}

static int publish_slot(const char *url, uint32_t slot) {
    static char whobuf[32];
    snprintf(whobuf, sizeof whobuf, "trainer-%u", slot);
    who = whobuf;
    mx_model *model = make_model();
    mx_publisher *pub = NULL;
    OK(mx_publisher_create(url, "fsdp:2", slot, model, &pub));
    mx_model_free(model);

    /* FSDP2 dim-0 shards (torch.chunk: ceil(rows / 2) rows per slot), one arena. */
    shard_t sh[MAX_TENSORS];
    size_t n = 0;
    uint64_t end = 0;
    for (size_t i = 0; i < n_tensors; i++) {
        uint64_t rows = tensors[i].shape[0], chunk = (rows + 1) / 2;
        uint64_t row0 = slot * chunk;
        if (row0 >= rows)
            continue;
        uint64_t cnt = rows - row0 < chunk ? rows - row0 : chunk;
        uint64_t cols = tensors[i].ndim == 2 ? tensors[i].shape[1] : 1;
        sh[n] = (shard_t){i, row0, cnt, end};
        end = (end + cnt * cols * 2 + 63) / 64 * 64;
        n++;
    }
    uint8_t *arena = aligned_alloc(64, end);
    if (!arena)
        die("out of memory");
    fill(arena, sh, n, 1);
    uint64_t mem = 0;
    OK(mx_publisher_register_host(pub, arena, end, &mem));

    mx_shard specs[MAX_TENSORS];
    uint64_t offs[MAX_TENSORS][2], exts[MAX_TENSORS][2];
    for (size_t i = 0; i < n; i++) {
        const tensor_t *t = &tensors[sh[i].tensor];
        offs[i][0] = sh[i].row0;
        offs[i][1] = 0;
        exts[i][0] = sh[i].rows;
        exts[i][1] = t->ndim == 2 ? t->shape[1] : 0;
        specs[i] = (mx_shard){.tensor = t->name,
                              .dtype = "BF16",
                              .global_shape = t->shape,
                              .box_offset = offs[i],
                              .box_shape = exts[i],
                              .ndim = t->ndim,
                              .memory = mem,
                              .offset = sh[i].offset};
    }

    /* Bad input first: each is refused, naming what is wrong, and changes nothing. */
    if (slot == 0) {
        mx_shard bad = specs[0];
        bad.dtype = "bfloat17";
        FAILS(mx_publisher_set_shards(pub, &bad, 1), MX_ERR_INVALID_ARGUMENT,
              "shards[0] (tensor model.embed_tokens.weight).dtype");
        bad = specs[0];
        bad.offset = end - 2; /* the shard's bytes run past the registered memory */
        FAILS(mx_publisher_set_shards(pub, &bad, 1), MX_ERR_INVALID_ARGUMENT,
              "model.embed_tokens.weight");
        FAILS(mx_publisher_set_shards(pub, &bad, 1), MX_ERR_INVALID_ARGUMENT, "outside memory");
        bad = specs[0];
        bad.memory = 7;
        FAILS(mx_publisher_set_shards(pub, &bad, 1), MX_ERR_INVALID_ARGUMENT, "unknown memory id 7");
        bad = specs[0];
        bad.tensor = NULL;
        FAILS(mx_publisher_set_shards(pub, &bad, 1), MX_ERR_INVALID_ARGUMENT, "shards[0].tensor");
        bad = specs[0];
        bad.box_shape = NULL;
        FAILS(mx_publisher_set_shards(pub, &bad, 1), MX_ERR_INVALID_ARGUMENT, "box_shape");
        FAILS(mx_publisher_set_shards(NULL, specs, n), MX_ERR_INVALID_ARGUMENT,
              "publisher: NULL handle");
        FAILS(mx_publisher_set_shards(pub, NULL, 3), MX_ERR_INVALID_ARGUMENT, "shards: NULL array");
        FAILS(mx_publisher_publish(pub, "step-1", 1, 1000, NULL), MX_ERR_STATE, "no shards set");
        FAILS(mx_publisher_publish(pub, NULL, 1, 1000, NULL), MX_ERR_INVALID_ARGUMENT,
              "label: NULL string");
        FAILS(mx_publisher_register_host(pub, NULL, 64, &mem), MX_ERR_INVALID_ARGUMENT, "addr");
        FAILS(mx_publisher_register_host(pub, arena, 0, &mem), MX_ERR_INVALID_ARGUMENT, "addr/len");
    }
    OK(mx_publisher_set_shards(pub, specs, n));

    /* step-1 as a snapshot: the memory may be overwritten as soon as publish returns. */
    char *id1 = NULL;
    OK(mx_publisher_publish(pub, "step-1", 1, 120000, &id1));
    printf("%s: published step-1 (copy) as %s\n", who, id1);
    CHECK(strncmp(id1, "mx:", 3) == 0 && strlen(id1) == 67, "bad version id %s", id1);
    /* Nothing stages step-1 through the control plane (the engine stages it by itself). */
    FAILS(mx_publisher_wait_staged(pub, "step-1", 300, NULL), MX_ERR_TIMEOUT, "step-1");
    fill(arena, sh, n, 2); /* the optimizer step, in place */

    /* step-2 in place: waits for the declaration, then READY; held until the refit stages it. */
    char *id2 = NULL, *why = NULL;
    OK(mx_publisher_publish(pub, "step-2", 0, 120000, &id2));
    printf("%s: published step-2 (in place) as %s\n", who, id2);
    CHECK(strcmp(id1, id2) != 0, "step-1 and step-2 have one id");
    OK(mx_publisher_wait_staged(pub, "step-2", 180000, &why));
    printf("%s: step-2 handed back: %s\n", who, why);
    CHECK(strstr(why, "Staged") != NULL, "step-2 released for another reason: %s", why);
    mx_string_free(id1);
    mx_string_free(id2);
    mx_string_free(why);
    mx_publisher_free(pub);
    free(arena);
    printf("%s: %d checks passed\n", who, checks);
    return 0;
}

/* ---- the engine (this process): tp:2, both ranks, one buffer per parameter ---- */

typedef struct {
    uint32_t rank;
    size_t index;
    mx_param_info info;
    uint8_t *mem;
} param_t;

static param_t *params;
static size_t n_params;

/* Every byte of every parameter: each piece is the row-major box of its tensor at `step`, and
 * bytes in no piece (vocab padding) are zero. Returns the number of bytes checked. */
static uint64_t verify(mx_puller *p, int step) {
    uint64_t bytes = 0;
    for (size_t i = 0; i < n_params; i++) {
        param_t *pa = &params[i];
        uint8_t *covered = calloc(pa->info.len ? pa->info.len : 1, 1);
        for (size_t k = 0; k < pa->info.piece_count; k++) {
            mx_piece_info pc;
            OK(mx_puller_piece_info(p, pa->rank, pa->index, k, &pc));
            size_t t = tensor_index(pc.tensor);
            uint64_t numel = 1;
            for (size_t d = 0; d < pc.ndim; d++)
                numel *= pc.box_shape[d];
            for (uint64_t q = 0; q < numel; q++) {
                /* local row-major index q -> global row-major index e */
                uint64_t rem = q, e = 0, stride = 1;
                for (size_t d = pc.ndim; d-- > 0;) {
                    uint64_t local = rem % pc.box_shape[d];
                    rem /= pc.box_shape[d];
                    e += (pc.box_offset[d] + local) * stride;
                    stride *= pc.global_shape[d];
                }
                for (int b = 0; b < 2; b++) {
                    uint64_t at = pc.offset + 2 * q + b;
                    if (at >= pa->info.len)
                        die("piece %s of %s runs past its %llu bytes", pc.tensor, pa->info.name,
                            (unsigned long long)pa->info.len);
                    uint8_t want = gen(t, e, b, step);
                    if (pa->mem[at] != want)
                        die("step-%d rank %u %s byte %llu (tensor %s element %llu): %u != %u",
                            step, pa->rank, pa->info.name, (unsigned long long)at, pc.tensor,
                            (unsigned long long)e, pa->mem[at], want);
                    covered[at] = 1;
                }
            }
        }
        for (uint64_t at = 0; at < pa->info.len; at++)
            if (!covered[at] && pa->mem[at] != 0)
                die("rank %u %s byte %llu is in no piece and not zero", pa->rank, pa->info.name,
                    (unsigned long long)at);
        free(covered);
        bytes += pa->info.len;
    }
    checks++;
    return bytes;
}

static void wait_ready(mx_control *c, const char *label) {
    for (int i = 0; i < 1200; i++) {
        char *state = NULL;
        OK(mx_control_version(c, label, &state, NULL));
        int ready = strcmp(state, "READY") == 0;
        mx_string_free(state);
        if (ready)
            return;
        usleep(100 * 1000);
    }
    die("%s did not become READY in 120 s", label);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static pid_t spawn_slot(const char *url, int slot) {
    char s[8];
    snprintf(s, sizeof s, "%d", slot);
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0)
        die("fork: %s", strerror(errno));
    if (pid == 0) {
        /* Only exec between fork and exec: the parent runs threads. */
        char *argv[] = {"refit", "publish", (char *)url, s, NULL};
        execv("/proc/self/exe", argv);
        _exit(127);
    }
    return pid;
}

static void versions(mx_puller *p, char **resident, char **retained) {
    OK(mx_puller_versions(p, resident, retained, NULL));
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    build_tensors();
    if (argc == 4 && strcmp(argv[1], "publish") == 0)
        return publish_slot(argv[2], (uint32_t)atoi(argv[3]));
    double t0 = now_s();
    printf("%s: libmx %s\n", who, mx_version());

    /* Bad input with no control plane involved. */
    mx_model *none = NULL;
    mx_tensor_spec bad_spec = {"model.norm.weight", "bfloat17", tensors[2].shape, 1};
    FAILS(mx_model_from_config(CONFIG, &bad_spec, 1, &none), MX_ERR_INVALID_ARGUMENT,
          "tensors[0] (model.norm.weight).dtype: unknown dtype \"bfloat17\"");
    FAILS(mx_model_from_config(NULL, &bad_spec, 1, &none), MX_ERR_INVALID_ARGUMENT,
          "config_json: NULL string");
    FAILS(mx_model_from_config("{not json", &bad_spec, 1, &none), MX_ERR_INVALID_ARGUMENT,
          "config_json");
    FAILS(mx_model_from_dir("/nonexistent/model", &none), MX_ERR_IO, "/nonexistent/model");
    CHECK(none == NULL, "a failed create wrote a handle");
    mx_model *model = make_model();
    size_t count = 0;
    OK(mx_model_tensor_count(model, &count));
    CHECK(count == n_tensors, "model has %zu tensors, not %zu", count, n_tensors);
    FAILS(mx_model_tensor_count(NULL, &count), MX_ERR_INVALID_ARGUMENT, "model: NULL handle");
    FAILS(mx_model_tensor_count(model, NULL), MX_ERR_INVALID_ARGUMENT, "out: NULL output pointer");
    /* The *_free functions take NULL. */
    mx_model_free(NULL);
    mx_puller_free(NULL);
    mx_publisher_free(NULL);
    mx_control_free(NULL);
    mx_control_plane_free(NULL);
    mx_string_free(NULL);

    char journal[] = "/tmp/mx-ffi-refit-XXXXXX";
    if (!mkdtemp(journal))
        die("mkdtemp: %s", strerror(errno));
    char journal_path[128];
    snprintf(journal_path, sizeof journal_path, "%s/journal.jsonl", journal);
    mx_control_plane *plane = NULL;
    char *url = NULL;
    OK(mx_control_plane_start("127.0.0.1:0", journal_path, &plane, &url));
    printf("%s: control plane at %s\n", who, url);
    mx_control *ctl = NULL;
    OK(mx_control_connect(url, &ctl));

    uint32_t ranks[2] = {0, 1};
    mx_puller *p = NULL;
    FAILS(mx_puller_create(url, "engine", "tp:3", ranks, 2, model, 1, &p), MX_ERR_LAYOUT, "tp:3");
    FAILS(mx_puller_create(url, "engine", "tp:2", ranks, 2, NULL, 1, &p), MX_ERR_INVALID_ARGUMENT,
          "model: NULL handle");
    FAILS(mx_puller_create(url, "engine", "tq:2", ranks, 2, model, 1, &p), MX_ERR_INVALID_ARGUMENT,
          "layout");
    FAILS(mx_puller_create(url, "engine", "tp:2", NULL, 2, model, 1, &p), MX_ERR_INVALID_ARGUMENT,
          "ranks: NULL array");
    CHECK(p == NULL, "a failed create wrote a handle");
    /* The engine's layout is registered before the trainers publish, as a fleet's workers are. */
    OK(mx_puller_create(url, "engine", "tp:2", ranks, 2, model, 1, &p));

    /* Allocate and register every parameter, as an engine holding its weights would. */
    size_t total = 0;
    for (uint32_t r = 0; r < 2; r++) {
        size_t c = 0;
        OK(mx_puller_param_count(p, r, &c));
        total += c;
    }
    params = calloc(total, sizeof *params);
    uint64_t rank_bytes = 0;
    for (uint32_t r = 0; r < 2; r++) {
        size_t c = 0;
        OK(mx_puller_param_count(p, r, &c));
        for (size_t i = 0; i < c; i++) {
            param_t *pa = &params[n_params++];
            pa->rank = r;
            pa->index = i;
            OK(mx_puller_param_info(p, r, i, &pa->info));
            pa->mem = malloc(pa->info.len);
            memset(pa->mem, 0xAB, pa->info.len);
            rank_bytes += pa->info.len;
            if (r == 0 && i == 0) {
                FAILS(mx_puller_register_param(p, r, pa->info.name, pa->mem, pa->info.len, "F32",
                                               pa->info.shape, pa->info.ndim),
                      MX_ERR_INVALID_ARGUMENT, pa->info.name);
                FAILS(mx_puller_register_param(p, r, pa->info.name, pa->mem, pa->info.len, "nope",
                                               pa->info.shape, pa->info.ndim),
                      MX_ERR_INVALID_ARGUMENT, "dtype (rank 0 parameter");
                FAILS(mx_puller_register_param(p, r, pa->info.name, pa->mem, pa->info.len - 2,
                                               pa->info.dtype, pa->info.shape, pa->info.ndim),
                      MX_ERR_INVALID_ARGUMENT, "bytes of memory");
                FAILS(mx_puller_register_param(p, r, pa->info.name, NULL, pa->info.len,
                                               pa->info.dtype, pa->info.shape, pa->info.ndim),
                      MX_ERR_INVALID_ARGUMENT, "NULL pointer");
                FAILS(mx_puller_register_param(p, 5, pa->info.name, pa->mem, pa->info.len,
                                               pa->info.dtype, pa->info.shape, pa->info.ndim),
                      MX_ERR_INVALID_ARGUMENT, "rank 5");
                FAILS(mx_puller_register_param(p, r, "no.such.weight", pa->mem, pa->info.len,
                                               pa->info.dtype, pa->info.shape, pa->info.ndim),
                      MX_ERR_INVALID_ARGUMENT, "no.such.weight");
                FAILS(mx_puller_serve(p, "engine", "127.0.0.1:0", NULL), MX_ERR_STATE,
                      "no destination memory");
            }
            OK(mx_puller_register_param(p, r, pa->info.name, pa->mem, pa->info.len,
                                        pa->info.dtype, pa->info.shape, pa->info.ndim));
        }
    }
    printf("%s: engine registered %zu parameters, %llu bytes\n", who, n_params,
           (unsigned long long)rank_bytes);
    FAILS(mx_puller_rollback(p), MX_ERR_STATE, "no version is retained yet");
    FAILS(mx_puller_apply(p, NULL), MX_ERR_STATE, "nothing is staged");

    /* Two trainer slots publish step-1 from their own memory. */
    OK(mx_control_declare(ctl, "step-1", "fsdp:2", model));
    pid_t kids[2] = {spawn_slot(url, 0), spawn_slot(url, 1)};
    wait_ready(ctl, "step-1");

    /* Stage by label over NIXL: the registered memory is not touched. */
    char *id1 = NULL, *resident = NULL, *retained = NULL;
    double t = now_s();
    OK(mx_puller_stage(p, "step-1", &id1));
    double stage_s = now_s() - t;
    for (size_t i = 0; i < n_params; i++)
        CHECK(params[i].mem[0] == 0xAB, "staging wrote %s", params[i].info.name);
    mx_memory_report mem;
    OK(mx_puller_memory_report(p, &mem));
    CHECK(mem.rank_bytes == rank_bytes, "rank_bytes %llu", (unsigned long long)mem.rank_bytes);
    CHECK(mem.staging_bytes_peak > 0 && mem.staging_bytes_peak <= mem.rank_bytes,
          "staging peak %llu > rank bytes %llu", (unsigned long long)mem.staging_bytes_peak,
          (unsigned long long)mem.rank_bytes);
    /* This process wrote the registered memory and staging: its resident set holds both. */
    CHECK(mem.process_rss_bytes_peak >= mem.process_rss_bytes &&
              mem.process_rss_bytes >= mem.rank_bytes + mem.staging_bytes,
          "resident set %llu (peak %llu) below registered %llu + staging %llu",
          (unsigned long long)mem.process_rss_bytes, (unsigned long long)mem.process_rss_bytes_peak,
          (unsigned long long)mem.rank_bytes, (unsigned long long)mem.staging_bytes);
    t = now_s();
    OK(mx_puller_apply(p, NULL));
    double apply_s = now_s() - t;
    uint64_t checked = verify(p, 1);
    versions(p, &resident, NULL);
    CHECK(resident && strcmp(resident, id1) == 0, "resident %s, not %s", resident, id1);
    mx_string_free(resident);
    printf("%s: step-1 %s staged in %.3f s, applied in %.3f s, %llu bytes byte-exact\n", who, id1,
           stage_s, apply_s, (unsigned long long)checked);

    /* Staging by id finds the label; unknown versions are refused. */
    char *again = NULL;
    OK(mx_puller_stage(p, id1, &again));
    CHECK(strcmp(again, id1) == 0, "staged %s for %s", again, id1);
    mx_string_free(again);
    FAILS(mx_puller_stage(p, "no-such-label", NULL), MX_ERR_UNKNOWN_VERSION, "no-such-label");
    FAILS(mx_puller_apply(p, "mx:00000000000000000000000000000000000000000000000000000000000000ff"),
          MX_ERR_UNKNOWN_VERSION, "not staged");
    FAILS(mx_puller_apply(p, "step-1"), MX_ERR_INVALID_ARGUMENT, "version_id");
    FAILS(mx_puller_stage(NULL, "step-1", NULL), MX_ERR_INVALID_ARGUMENT, "puller: NULL handle");
    FAILS(mx_puller_stage(p, NULL, NULL), MX_ERR_INVALID_ARGUMENT, "version: NULL string");
    FAILS(mx_puller_piece_info(p, 0, 100000, 0, NULL), MX_ERR_INVALID_ARGUMENT, "index");
    FAILS(mx_control_refit(ctl, "step-1", NULL, 1, 0, 1000, NULL, NULL), MX_ERR_INVALID_ARGUMENT,
          "worker_ids: NULL array");

    /* step-2: the engine is served as a worker; the control plane refits it. */
    char *engine_url = NULL;
    OK(mx_puller_serve(p, "engine", "127.0.0.1:0", &engine_url));
    printf("%s: engine routes at %s\n", who, engine_url);
    OK(mx_control_declare(ctl, "step-2", "fsdp:2", model));
    wait_ready(ctl, "step-2");
    const char *set[] = {"engine"};
    mx_refit_outcome outcome = -1;
    char *result = NULL;
    t = now_s();
    OK(mx_control_refit(ctl, "step-2", set, 1, 1, 180000, &outcome, &result));
    double refit_s = now_s() - t;
    CHECK(outcome == MX_REFIT_COMMITTED, "refit ended %d: %s", outcome, result);
    CHECK(strstr(result, "\"outcome\":\"committed\"") != NULL, "result: %s", result);
    checked = verify(p, 2);
    char *id2 = NULL;
    OK(mx_control_version(ctl, "step-2", NULL, &id2));
    versions(p, &resident, &retained);
    CHECK(resident && strcmp(resident, id2) == 0, "resident %s, not %s", resident, id2);
    CHECK(retained && strcmp(retained, id1) == 0, "retained %s, not %s", retained, id1);
    mx_string_free(resident);
    mx_string_free(retained);
    char *status = NULL;
    OK(mx_control_status(ctl, &status));
    CHECK(strstr(status, id2) != NULL, "status lacks %s: %s", id2, status);
    mx_string_free(status);
    printf("%s: step-2 %s refitted (COMMITTED) in %.3f s, %llu bytes byte-exact\n", who, id2,
           refit_s, (unsigned long long)checked);

    /* Rollback: once served, the control plane drives it: a refit back to step-1, which the
       engine holds in its retained copy (nothing pulled). Directly it is refused. */
    FAILS(mx_puller_rollback(p), MX_ERR_STATE, "served");
    FAILS(mx_puller_apply(p, NULL), MX_ERR_STATE, "served");
    mx_string_free(result);
    result = NULL;
    OK(mx_control_refit(ctl, "step-1", set, 1, 1, 180000, &outcome, &result));
    CHECK(outcome == MX_REFIT_COMMITTED, "rollback refit ended %d: %s", outcome, result);
    verify(p, 1);
    versions(p, &resident, NULL);
    CHECK(resident && strcmp(resident, id1) == 0, "after rollback resident %s", resident);
    mx_string_free(resident);
    char *digests = NULL;
    OK(mx_puller_live_digests(p, &digests));
    CHECK(strstr(digests, "qkv_proj") != NULL, "digests: %.200s", digests);
    mx_string_free(digests);

    for (int k = 0; k < 2; k++) {
        int ws = 0;
        if (waitpid(kids[k], &ws, 0) < 0)
            die("waitpid: %s", strerror(errno));
        CHECK(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "trainer slot %d failed (status %d)", k, ws);
    }

    mx_string_free(result);
    mx_string_free(engine_url);
    mx_string_free(id1);
    mx_string_free(id2);
    mx_puller_free(p);
    mx_control_free(ctl);
    mx_model_free(model);
    mx_control_plane_free(plane);
    mx_string_free(url);
    unlink(journal_path);
    rmdir(journal);
    for (size_t i = 0; i < n_params; i++)
        free(params[i].mem);
    free(params);
    printf("%s: %d checks passed in %.1f s\n", who, checks, now_s() - t0);
    return 0;
}
