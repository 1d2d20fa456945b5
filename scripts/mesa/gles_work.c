/*
 * A small GLES 3.1 program for Mesa's iris driver on drm-shim: clears, a
 * triangle, a framebuffer blit and a buffer copy (blorp), a compute
 * dispatch that writes a buffer, then glFinish. Its batches are what the
 * corpus keeps (scripts/mesa/regen-corpus.sh).
 */
#include <EGL/egl.h>
#include <EGL/eglext.h>
#include <GLES3/gl31.h>
#include <stdio.h>
#include <stdlib.h>

static GLuint shader(GLenum type, const char *src)
{
	GLuint s = glCreateShader(type);
	GLint ok = 0;

	glShaderSource(s, 1, &src, NULL);
	glCompileShader(s);
	glGetShaderiv(s, GL_COMPILE_STATUS, &ok);
	if (!ok) {
		char log[1024];

		glGetShaderInfoLog(s, sizeof(log), NULL, log);
		fprintf(stderr, "shader: %s\n", log);
		exit(1);
	}
	return s;
}

static GLuint program(GLuint a, GLuint b)
{
	GLuint p = glCreateProgram();
	GLint ok = 0;

	glAttachShader(p, a);
	if (b)
		glAttachShader(p, b);
	glLinkProgram(p);
	glGetProgramiv(p, GL_LINK_STATUS, &ok);
	if (!ok) {
		fprintf(stderr, "link failed\n");
		exit(1);
	}
	return p;
}

static GLuint target(GLsizei w, GLsizei h)
{
	GLuint fb, tex;

	glGenTextures(1, &tex);
	glBindTexture(GL_TEXTURE_2D, tex);
	glTexStorage2D(GL_TEXTURE_2D, 1, GL_RGBA8, w, h);
	glGenFramebuffers(1, &fb);
	glBindFramebuffer(GL_FRAMEBUFFER, fb);
	glFramebufferTexture2D(GL_FRAMEBUFFER, GL_COLOR_ATTACHMENT0,
			       GL_TEXTURE_2D, tex, 0);
	return fb;
}

int main(void)
{
	PFNEGLGETPLATFORMDISPLAYEXTPROC get_display =
		(void *)eglGetProcAddress("eglGetPlatformDisplayEXT");
	EGLDisplay dpy = get_display(EGL_PLATFORM_SURFACELESS_MESA,
				     EGL_DEFAULT_DISPLAY, NULL);
	static const EGLint cfg_attr[] = { EGL_RENDERABLE_TYPE, EGL_OPENGL_ES3_BIT,
					   EGL_SURFACE_TYPE, EGL_PBUFFER_BIT, EGL_NONE };
	static const EGLint ctx_attr[] = { EGL_CONTEXT_MAJOR_VERSION, 3,
					   EGL_CONTEXT_MINOR_VERSION, 1, EGL_NONE };
	static const float tri[] = { -1, -1, 1, -1, 0, 1 };
	EGLConfig cfg;
	EGLint n;
	EGLContext ctx;
	GLuint fb1, fb2, vbo, prog, cprog, buf[2];

	if (!eglInitialize(dpy, NULL, NULL) ||
	    !eglChooseConfig(dpy, cfg_attr, &cfg, 1, &n) || n < 1) {
		fprintf(stderr, "EGL init failed\n");
		return 1;
	}
	eglBindAPI(EGL_OPENGL_ES_API);
	ctx = eglCreateContext(dpy, cfg, EGL_NO_CONTEXT, ctx_attr);
	if (!ctx || !eglMakeCurrent(dpy, EGL_NO_SURFACE, EGL_NO_SURFACE, ctx)) {
		fprintf(stderr, "no context\n");
		return 1;
	}
	printf("renderer: %s\n", glGetString(GL_RENDERER));

	fb1 = target(256, 256);
	fb2 = target(256, 256);

	/* A clear (blorp fast clear or a clear rectangle). */
	glBindFramebuffer(GL_FRAMEBUFFER, fb1);
	glViewport(0, 0, 256, 256);
	glClearColor(0.2f, 0.4f, 0.6f, 1.0f);
	glClear(GL_COLOR_BUFFER_BIT);
	glFlush();

	/* A triangle. */
	prog = program(shader(GL_VERTEX_SHADER,
			      "#version 310 es\nlayout(location=0) in vec2 p;\n"
			      "void main(){gl_Position=vec4(p,0,1);}\n"),
		       shader(GL_FRAGMENT_SHADER,
			      "#version 310 es\nprecision mediump float;\n"
			      "out vec4 c;void main(){c=vec4(1,0.5,0,1);}\n"));
	glGenBuffers(1, &vbo);
	glBindBuffer(GL_ARRAY_BUFFER, vbo);
	glBufferData(GL_ARRAY_BUFFER, sizeof(tri), tri, GL_STATIC_DRAW);
	glVertexAttribPointer(0, 2, GL_FLOAT, GL_FALSE, 0, 0);
	glEnableVertexAttribArray(0);
	glUseProgram(prog);
	glDrawArrays(GL_TRIANGLES, 0, 3);
	glFlush();

	/* A blit from one framebuffer to the other (blorp). */
	glBindFramebuffer(GL_READ_FRAMEBUFFER, fb1);
	glBindFramebuffer(GL_DRAW_FRAMEBUFFER, fb2);
	glBlitFramebuffer(0, 0, 256, 256, 0, 0, 128, 128,
			  GL_COLOR_BUFFER_BIT, GL_LINEAR);
	glFlush();

	/* A buffer copy (blorp buffer copy). */
	glGenBuffers(2, buf);
	glBindBuffer(GL_COPY_READ_BUFFER, buf[0]);
	glBufferData(GL_COPY_READ_BUFFER, 65536, NULL, GL_STATIC_DRAW);
	glBindBuffer(GL_COPY_WRITE_BUFFER, buf[1]);
	glBufferData(GL_COPY_WRITE_BUFFER, 65536, NULL, GL_STATIC_DRAW);
	glCopyBufferSubData(GL_COPY_READ_BUFFER, GL_COPY_WRITE_BUFFER, 0, 0, 65536);
	glFlush();

	/* A compute dispatch writing a buffer. */
	cprog = program(shader(GL_COMPUTE_SHADER,
			       "#version 310 es\nlayout(local_size_x=64) in;\n"
			       "layout(std430,binding=0) buffer B{uint v[];};\n"
			       "void main(){v[gl_GlobalInvocationID.x]=gl_GlobalInvocationID.x;}\n"),
			0);
	glUseProgram(cprog);
	glBindBufferBase(GL_SHADER_STORAGE_BUFFER, 0, buf[1]);
	glDispatchCompute(256, 1, 1);
	glMemoryBarrier(GL_ALL_BARRIER_BITS);
	glFinish();

	eglMakeCurrent(dpy, EGL_NO_SURFACE, EGL_NO_SURFACE, EGL_NO_CONTEXT);
	eglTerminate(dpy);
	printf("done\n");
	return 0;
}
