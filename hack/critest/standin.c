/*
 * Stand-ins for the programs of critest's test images, so the suite runs
 * offline against images hack/critest.sh builds from busybox. One static
 * binary; what it does depends on the name it is installed under:
 *
 *   nginx       writes its pid to /var/run/nginx.pid, re-executes itself as
 *               "nginx: master process ..." (critest looks for that in
 *               /proc/1/cmdline and for the name with pidof) and serves
 *               HTTP 200 on $PORT (default 80)
 *   httpd       says "httpd: serving on port N" on stdout and serves HTTP 200
 *               on $PORT (default 80)
 *   nonewprivs  installed setuid root: prints "Effective uid: N"
 *
 * Build: cc -static -O2 -o standin standin.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *base(const char *p) {
    const char *s = strrchr(p, '/');
    return s ? s + 1 : p;
}

static void on_term(int sig) {
    (void)sig;
    _exit(0);
}

static int serve(int port) {
    int fd = socket(AF_INET6, SOCK_STREAM, 0);
    int v6only = 0, one = 1;
    struct sockaddr_in6 a;
    if (fd < 0) {
        perror("socket");
        return 1;
    }
    setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, sizeof v6only);
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    memset(&a, 0, sizeof a);
    a.sin6_family = AF_INET6;
    a.sin6_port = htons((unsigned short)port);
    a.sin6_addr = in6addr_any;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || listen(fd, 64) < 0) {
        perror("bind/listen");
        return 1;
    }
    signal(SIGTERM, on_term);
    signal(SIGINT, on_term);
    signal(SIGCHLD, SIG_IGN);
    static const char body[] = "<html><body>critest stand-in</body></html>\n";
    char resp[256];
    int n = snprintf(resp, sizeof resp,
                     "HTTP/1.0 200 OK\r\nContent-Type: text/html\r\n"
                     "Content-Length: %zu\r\nConnection: close\r\n\r\n%s",
                     sizeof body - 1, body);
    for (;;) {
        int c = accept(fd, NULL, NULL);
        if (c < 0) {
            if (errno == EINTR)
                continue;
            perror("accept");
            return 1;
        }
        char buf[4096];
        /* One read is enough for the GET requests critest sends. */
        if (read(c, buf, sizeof buf) > 0)
            (void)!write(c, resp, (size_t)n);
        close(c);
    }
}

static int port_from_env(void) {
    const char *p = getenv("PORT");
    return p && *p ? atoi(p) : 80;
}

int main(int argc, char **argv) {
    const char *self = base(argv[0]);
    if (strstr(argv[0], "master process")) {
        FILE *f = fopen("/var/run/nginx.pid", "w");
        if (f) {
            fprintf(f, "%d\n", (int)getpid());
            fclose(f);
        }
        printf("nginx: serving on port %d\n", port_from_env());
        fflush(stdout);
        return serve(port_from_env());
    }
    if (strcmp(self, "nginx") == 0) {
        /* The file name stays "nginx" (comm, pidof); the command line
         * becomes what nginx's master shows. */
        char *args[] = {"nginx: master process nginx -g daemon off;", NULL};
        char exe[4096];
        ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
        (void)argc;
        if (len <= 0) {
            perror("readlink");
            return 1;
        }
        exe[len] = 0;
        execv(exe, args);
        perror("execv");
        return 1;
    }
    if (strcmp(self, "nonewprivs") == 0) {
        printf("Effective uid: %d\n", (int)geteuid());
        return 0;
    }
    printf("httpd: serving on port %d\n", port_from_env());
    fflush(stdout);
    return serve(port_from_env());
}
